"""A small causal genome LM over long nucleotide sequences: activation checkpointing on one
process, and sequence parallelism (ring or Ulysses attention) over several.

GenSLM-style recipe (DeepSpeed4Science, sec. "GenSLMs") at laptop scale: a LLaMA-style
``slipstream.models.GPT`` with a 4-token vocabulary (ACGT) trains through
``slipstream.initialize`` on synthetic genomes whose planted motifs are learnable
(``slipstream.science.synthetic_genomes``). Each block is checkpointed
(``GPTConfig.activation_checkpointing``), so activation memory grows with the sequence
length by one hidden state per layer instead of all block internals.

The other half of the GenSLMs recipe is sequence parallelism: started on several processes
with ``--sequence-parallel ring`` (or ``ulysses``), every sequence is split over the ranks
(``sequence_parallel_size`` = world; ring attention cuts it zig-zag, chunks ``r`` and
``2P-1-r`` of ``2P`` on rank ``r``), each rank holds its part of every activation and the
attention exchanges the rest. Each rank then prints the peak tensor memory of one forward and
backward on its part against the same step on the whole sequence without sequence
parallelism (``--no-compare`` skips that, e.g. when the whole sequence does not fit).

    python examples/genome_lm.py                                # ~1 minute on 2 CPU cores
    python examples/genome_lm.py --steps 0 --mem-seq-len 8192   # memory comparison only
    slipstream run --nproc 2 examples/genome_lm.py --sequence-parallel ring --seq-len 16384

On one process, unless ``--no-compare``, it measures one training step's peak memory of a
deeper model (``--mem-layers``) at ``--mem-seq-len``, with and without checkpointing, each in
a fresh process: the peak RSS above the RSS after building the model and engine (Linux
``VmHWM`` reset through ``/proc/self/clear_refs``; whole-process ``ru_maxrss`` elsewhere),
measured on the first step, and the exact peak of live tensor bytes of the next step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import slipstream
from slipstream.models import GPT, GPTConfig
from slipstream.science import synthetic_genomes
from slipstream.science._memory import TensorMemoryTracker
from slipstream.sequence import shard_batch_zigzag, shard_sequence


def build(args: argparse.Namespace, checkpointing: bool, sp: str | None = None) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab_size=4,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        max_seq_len=args.seq_len,
        activation_checkpointing=checkpointing,
        sequence_parallel=sp,
    )
    return GPT(cfg)


def engine_config(args: argparse.Namespace) -> dict[str, object]:
    return {
        "train_micro_batch_size_per_gpu": args.batch,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.0}},
        "gradient_clipping": 1.0,
    }


@torch.no_grad()
def evaluate(model: GPT, tokens: torch.Tensor, in_motif: torch.Tensor) -> tuple[float, float]:
    """Mean next-base loss (nats) on predictable motif positions and on the background."""
    logits = model(tokens[:, :-1]).float()
    loss = torch.nn.functional.cross_entropy(
        logits.transpose(1, 2), tokens[:, 1:], reduction="none"
    )
    motif = in_motif[:, 1:]
    return loss[motif].mean().item(), loss[~motif].mean().item()


def train(args: argparse.Namespace) -> None:
    data = synthetic_genomes(args.batch * args.steps, args.seq_len + 1, seed=0)
    held_out = synthetic_genomes(2, args.seq_len + 1, seed=1)  # new sequences, same motifs
    model = build(args, checkpointing=not args.no_checkpointing)
    engine, _, _, _ = slipstream.initialize(model=model, config=engine_config(args))
    motif0, background0 = evaluate(engine.module, held_out.tokens, held_out.in_motif)
    for step in range(args.steps):
        batch = data.tokens[step * args.batch : (step + 1) * args.batch]
        loss = engine(batch[:, :-1], batch[:, 1:])
        engine.backward(loss)
        engine.step()
        if step % max(1, args.steps // 4) == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {loss.item():.3f} nats/base")
    motif, background = evaluate(engine.module, held_out.tokens, held_out.in_motif)
    print(
        f"held-out loss on motif bases {motif0:.3f} -> {motif:.3f}, background "
        f"{background0:.3f} -> {background:.3f} nats (uniform: log 4 = {math.log(4):.3f})"
    )
    engine.destroy()


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _reset_peak() -> bool:
    try:  # Linux >= 4.0: resets VmHWM to the current RSS
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _step(engine: slipstream.Engine, batch: torch.Tensor) -> None:
    engine.backward(engine(batch[:, :-1], batch[:, 1:]))
    engine.step()


def measure_child(args: argparse.Namespace) -> None:
    """One process, one checkpointing setting: peak memory of a training step, as JSON."""
    args.layers, args.seq_len, args.batch = args.mem_layers, args.mem_seq_len, 1
    model = build(args, checkpointing=args.child == "on")
    engine, _, _, _ = slipstream.initialize(model=model, config=engine_config(args))
    batch = synthetic_genomes(1, args.seq_len + 1, seed=0).tokens
    # RSS first, on a process that has not trained yet (later steps reuse freed memory).
    linux = Path("/proc/self/status").exists() and _reset_peak()
    base_kib = _rss_kib("VmRSS") if linux else 0
    _step(engine, batch)
    if linux:
        peak_kib = _rss_kib("VmHWM") - base_kib
    else:  # whole-process peak (bytes on macOS, KiB on Linux-likes)
        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with TensorMemoryTracker() as mem:  # exact live-tensor peak of one step
        _step(engine, batch)
    engine.destroy()
    print(json.dumps({"rss_peak_mib": peak_kib / 1024, "tensor_peak_mib": mem.peak_bytes / 2**20}))


def compare(args: argparse.Namespace) -> None:
    """Run :func:`measure_child` with and without checkpointing in fresh processes."""
    results = {}
    for setting in ("off", "on"):
        cmd = [sys.executable, __file__, "--child", setting, *_shape_flags(args)]
        # A fresh single-process world: drop the rendezvous variables this process's own
        # init_distributed exported, or the child would try to bind the same port.
        dist_vars = {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"}
        env = {k: v for k, v in os.environ.items() if k not in dist_vars | {"LOCAL_WORLD_SIZE"}}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"memory child ({setting}) failed:\n{proc.stderr[-2000:]}")
        results[setting] = json.loads(proc.stdout.strip().splitlines()[-1])
    off, on = results["off"], results["on"]
    print(
        f"peak memory of a training step at seq_len={args.mem_seq_len}, batch 1, "
        f"{args.mem_layers} layers x {args.hidden} hidden:"
    )
    for key, label in (("tensor_peak_mib", "live tensors"), ("rss_peak_mib", "process RSS")):
        print(
            f"  {label:<13} without checkpointing {off[key]:7.1f} MiB, with {on[key]:7.1f} MiB "
            f"({off[key] / max(on[key], 1e-9):.1f}x lower)"
        )


def _shape_flags(args: argparse.Namespace) -> list[str]:
    return [
        f"--mem-seq-len={args.mem_seq_len}",
        f"--mem-layers={args.mem_layers}",
        f"--hidden={args.hidden}",
        f"--heads={args.heads}",
    ]


# ------------------------------------------------------------- sequence parallelism (ranks)
def _shard(x: torch.Tensor, mode: str) -> torch.Tensor:
    """This rank's part of ``x`` [B, S] in the layout the attention expects."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if mode == "ring":
        return shard_batch_zigzag(x, world, rank)  # type: ignore[no-any-return]
    return shard_sequence(x, world, rank)  # type: ignore[no-any-return]


def _fwd_bwd_peak(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """Peak bytes of tensors allocated during one forward and backward."""
    with TensorMemoryTracker() as mem:
        model(x, y).backward()
    model.zero_grad(set_to_none=True)
    return mem.peak_bytes


@torch.no_grad()
def evaluate_sharded(
    model: GPT, tokens: torch.Tensor, in_motif: torch.Tensor, mode: str
) -> tuple[float, float]:
    """:func:`evaluate` on sequence shards: token losses summed over the ranks."""
    x, y, motif = (_shard(t, mode) for t in (tokens[:, :-1], tokens[:, 1:], in_motif[:, 1:]))
    loss = torch.nn.functional.cross_entropy(model(x).float().transpose(1, 2), y, reduction="none")
    sums = torch.stack([loss[motif].sum(), motif.sum(), loss[~motif].sum(), (~motif).sum()])
    sums = sums.double()
    dist.all_reduce(sums)
    return (sums[0] / sums[1]).item(), (sums[2] / sums[3]).item()


def train_sequence_parallel(args: argparse.Namespace) -> None:
    """Every rank holds 1/P of every sequence; the loss is that of the whole sequences."""
    mode = args.sequence_parallel
    slipstream.init_distributed()
    world, rank = dist.get_world_size(), dist.get_rank()
    data = synthetic_genomes(args.batch * max(args.steps, 1), args.seq_len + 1, seed=0)
    first = data.tokens[: args.batch]
    if not args.no_compare:  # no SP: the whole sequence on one process (rank 0 measures)
        alone = torch.zeros((), dtype=torch.float64)
        if rank == 0:
            alone += _fwd_bwd_peak(build(args, True), first[:1, :-1], first[:1, 1:])
        dist.broadcast(alone, 0)
    config = dict(engine_config(args), sequence_parallel_size=world)
    config["sequence_parallel_mode"] = "ring" if mode == "ring" else "ulysses"
    config["train_micro_batch_size_per_gpu"] = args.batch
    engine, _, _, _ = slipstream.initialize(model=build(args, True, mode), config=config)
    if not args.no_compare:
        mine = torch.tensor(
            float(
                _fwd_bwd_peak(
                    engine.module, _shard(first[:1, :-1], mode), _shard(first[:1, 1:], mode)
                )
            ),
            dtype=torch.float64,
        )
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        if rank == 0:
            print(
                f"peak tensor memory of one forward+backward, seq_len={args.seq_len}, batch 1, "
                f"{args.layers} layers x {args.hidden} hidden, checkpointed:\n"
                f"  no sequence parallelism (1 process): {alone.item() / 2**20:8.1f} MiB\n"
                f"  {mode} over {world} ranks (per rank):  {mine.item() / 2**20:8.1f} MiB "
                f"({alone.item() / max(mine.item(), 1.0):.2f}x lower)",
                flush=True,
            )
    held_out = synthetic_genomes(2, args.seq_len + 1, seed=1)
    motif0, background0 = evaluate_sharded(engine.module, held_out.tokens, held_out.in_motif, mode)
    for step in range(args.steps):
        batch = data.tokens[step * args.batch : (step + 1) * args.batch]
        start = time.perf_counter()
        loss = engine(_shard(batch[:, :-1], mode), _shard(batch[:, 1:], mode))
        engine.backward(loss)
        engine.step()
        took = time.perf_counter() - start
        if rank == 0 and (step % max(1, args.steps // 4) == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {loss.item():.3f} nats/base  ({took:.1f} s)", flush=True)
    motif, background = evaluate_sharded(engine.module, held_out.tokens, held_out.in_motif, mode)
    if rank == 0:
        print(
            f"held-out loss on motif bases {motif0:.3f} -> {motif:.3f}, background "
            f"{background0:.3f} -> {background:.3f} nats (uniform: log 4 = {math.log(4):.3f})"
        )
    engine.destroy()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=2048, help="nucleotides per sequence")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=100, help="training steps (0: skip training)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--no-checkpointing", action="store_true", help="train without it")
    p.add_argument("--no-compare", action="store_true", help="skip the memory comparison")
    p.add_argument("--mem-seq-len", type=int, default=4096, help="memory comparison: length")
    p.add_argument("--mem-layers", type=int, default=6, help="memory comparison: layers")
    p.add_argument(
        "--sequence-parallel",
        choices=["ring", "ulysses"],
        help="split every sequence over the processes (start with `slipstream run --nproc P`)",
    )
    p.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--child", choices=["on", "off"], help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        measure_child(args)
        return
    if args.sequence_parallel:
        train_sequence_parallel(args)
        return
    if args.steps > 0:
        train(args)
    if not args.no_compare:
        compare(args)


if __name__ == "__main__":
    main()
