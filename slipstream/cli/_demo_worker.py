"""One rank of ``slipstream demo``: ordinary DeepSpeed-style training code."""

from __future__ import annotations

import argparse
import math
import os
import time

import torch

import slipstream
from slipstream import comm as dist
from slipstream.cli._rank_entry import die_with_launcher
from slipstream.cli.demo import add_worker_arguments
from slipstream.data import ByteTokenizer, TokenDataset, encode_corpus, load_corpus, split_train_val
from slipstream.models import GPT, GPTConfig
from slipstream.profiling.plots import plot_run


def _config(args: argparse.Namespace, bf16: bool) -> dict[str, object]:
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": args.lr, "betas": [0.9, 0.95], "weight_decay": 0.1},
        },
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {
                "total_num_steps": args.steps,
                "warmup_num_steps": max(1, args.steps // 10),
                "warmup_type": "linear",
            },
        },
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": args.zero_stage, "overlap_comm": True},
        "bf16": {"enabled": bf16},
        "seed": args.seed,
        # Curves for `slipstream plot`: the engine's loss and lr, and the scalars main() adds.
        "csv_monitor": {"enabled": True, "output_path": args.run_dir, "job_name": "demo"},
        "flops_profiler": {
            "enabled": True,
            "profile_step": 2,
            "detailed": False,
            "output_file": os.path.join(args.run_dir, "flops_profile.txt"),
        },
    }


@torch.no_grad()
def _evaluate(engine: slipstream.Engine, data: TokenDataset, batches: int, batch: int) -> float:
    """Mean validation loss over the same ``batches`` batches on every rank, averaged over ranks."""
    engine.eval()
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.zeros((), device=engine.device)
    for b in range(batches):
        idx = [(b * world + rank) * batch + i for i in range(batch)]
        x = torch.stack([data[i % len(data)][0] for i in idx]).to(engine.device)
        y = torch.stack([data[i % len(data)][1] for i in idx]).to(engine.device)
        total += engine(x, y).float()
    dist.all_reduce(total)
    engine.train()
    return float(total) / (batches * world)


def _write_step_scalars(engine: slipstream.Engine, seconds: float, tokens: int) -> None:
    """User scalars of one optimizer step that took ``seconds`` for ``tokens`` tokens, through
    DeepSpeed's ``engine.monitor.write_events`` (rank 0 writes)."""
    step = engine.global_samples
    events = [("Train/Samples/tokens_per_sec", tokens / seconds, step)]
    norm = engine.get_global_grad_norm()
    if norm is not None:
        events.append(("Train/Samples/grad_norm", norm, step))
    profiler = engine.flops_profiler
    if profiler is not None and profiler.flops_per_step is not None:
        peak = profiler.peak_flops()
        if peak:
            events.append(
                ("Train/Samples/mfu", 100 * profiler.flops_per_step / seconds / peak, step)
            )
    engine.monitor.write_events(events)


def main() -> None:
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    args = parser.parse_args()
    slipstream.init_distributed()
    torch.manual_seed(args.seed)
    bf16 = args.precision == "bf16" or (args.precision == "auto" and torch.cuda.is_available())
    rank = dist.get_rank()

    tokenizer = ByteTokenizer()
    tokens = encode_corpus(load_corpus(), dtype=torch.uint8)
    train_tokens, val_tokens = split_train_val(tokens, 0.05)
    train, val = TokenDataset(train_tokens, args.seq_len), TokenDataset(val_tokens, args.seq_len)
    model = GPT(GPTConfig.preset(args.preset, max_seq_len=max(args.seq_len, 64)))
    engine, _, loader, _ = slipstream.initialize(
        model=model, training_data=train, config=_config(args, bf16)
    )
    if rank == 0:
        print(
            f"slipstream demo: GPT-{args.preset} {model.num_params() / 1e6:.2f}M params, "
            f"{len(tokens) / 1e6:.2f}M-byte corpus, world {dist.get_world_size()}, ZeRO-{args.zero_stage}, "
            f"{'bf16' if bf16 else 'fp32'}, global batch {engine.train_batch_size()} x {args.seq_len} tokens",
            flush=True,
        )
    val_before = _evaluate(engine, val, 4, args.micro_batch)
    tokens_per_step = engine.train_batch_size() * args.seq_len
    bar = None
    if rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=args.steps, desc="training", unit="step", dynamic_ncols=True)
    step_times: list[float] = []
    epoch, it = 0, iter(loader)
    start = last_boundary = time.perf_counter()
    while engine.global_steps < args.steps:
        try:
            x, y = next(it)
        except StopIteration:
            epoch += 1
            loader.sampler.set_epoch(epoch)
            it = iter(loader)
            continue
        t0 = time.perf_counter()
        loss = engine(x.to(engine.device), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        if engine.is_gradient_accumulation_boundary() or args.grad_accum == 1:
            now = time.perf_counter()
            step_times.append(now - t0)
            _write_step_scalars(engine, now - last_boundary, tokens_per_step)
            last_boundary = now
        if bar is not None and engine.micro_steps % args.grad_accum == 0:
            median = sorted(step_times)[len(step_times) // 2] if step_times else math.nan
            bar.set_postfix(
                loss=f"{float(loss.detach()):.3f}", tok_s=f"{tokens_per_step / median:,.0f}"
            )
            bar.update(1)
    elapsed = time.perf_counter() - start
    if bar is not None:
        bar.close()
    val_after = _evaluate(engine, val, 4, args.micro_batch)
    if rank == 0:
        print(
            f"validation loss {val_before:.3f} -> {val_after:.3f} (nats/byte; drop {val_before - val_after:.3f}); "
            f"{engine.global_steps} steps in {elapsed:.1f}s, "
            f"{engine.global_steps * tokens_per_step / elapsed:,.0f} tokens/s over {dist.get_world_size()} ranks",
            flush=True,
        )
    if rank == 0:
        engine.monitor.flush()
        plots = plot_run(args.run_dir, os.path.join(args.run_dir, "plots"))
        print(f"curves: {plots[-1]} (and {len(plots) - 1} more PNGs)", flush=True)
    # Every rank gathers the (ZeRO-3 partitioned) weights once; rank 0 samples with them.
    engine.eval()
    with engine.gathered_for_generation() as module:
        if rank == 0:
            ids = torch.tensor([tokenizer.encode("def ")], device=engine.device)
            gen = torch.Generator(device=engine.device).manual_seed(args.seed)
            out = module.generate(ids, args.sample_tokens, temperature=0.8, top_k=40, generator=gen)
            print("sample:\n" + tokenizer.decode(out[0].tolist()), flush=True)
        dist.barrier()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    die_with_launcher()  # as every rank started by slipstream run (see _rank_entry)
    main()
