"""3D parallelism: step time and per-rank memory of TP / PP / DP combinations on the reference
GPT, and DeepSpeed's pipeline engine on the same layers, in one run.

Every configuration trains the same model (the reference GPT; for pipelines its embedding,
blocks and head as pipeline layers) on the same global batch: ``--micro`` sequences per
micro-batch, ``--micro-batches`` micro-batches per optimizer step in all (each of the dp
data-parallel ranks runs 1/dp of them), AdamW, fp32, ZeRO-1
over the data-parallel ranks (DeepSpeed's pipeline engine allows ZeRO-1 at most). One step is
one optimizer step: ``train_batch`` for pipelines, ``--micro-batches`` forward/backward calls
then ``step`` otherwise. Each configuration runs in its own fresh world; see
``benchmarks/_harness.py`` for how time (slowest rank's median) and memory (peak RSS above the
baseline, per rank) are taken. Pipelines also print the bubble fraction of their schedule's
timeline (theory) and the measured idle share of the last step (1 - compute time / step time,
mean over ranks: it includes communication and, on a shared CPU, waiting for a core).

    python benchmarks/parallel3d.py                    # world 4: all configurations
    python benchmarks/parallel3d.py --runs dp4,pp4-1f1b,ds-pp4 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
from torch import nn

from benchmarks._harness import BenchConfig, PeakMemory, spawn_world
from slipstream.distributed.mesh import dp_group
from slipstream.models.gpt import GPT, GPTConfig
from slipstream.models.gpt_pipeline import gpt_loss, gpt_pipeline_layers

_MB = 2**20


@dataclass(frozen=True)
class Run:
    """One configuration: framework and the sizes of each axis (dp = world / (tp x pp))."""

    framework: str  # "slipstream", "deepspeed" (pipeline engine) or "ddp"
    tp: int = 1
    pp: int = 1
    schedule: str = "1f1b"
    virtual: int = 1
    zero: int = 1  # ZeRO stage over the data-parallel ranks


RUNS: dict[str, Run] = {
    "ddp4": Run("ddp"),
    "dp4": Run("slipstream"),
    "dp4-zero3": Run("slipstream", zero=3),
    "tp2-dp2": Run("slipstream", tp=2),
    "tp4": Run("slipstream", tp=4),
    "pp2-dp2-1f1b": Run("slipstream", pp=2),
    "pp2-dp2-gpipe": Run("slipstream", pp=2, schedule="gpipe"),
    "pp2-dp2-zero3": Run("slipstream", pp=2, zero=3),
    "ds-pp2-dp2": Run("deepspeed", pp=2),
    "pp4-1f1b": Run("slipstream", pp=4),
    "pp4-gpipe": Run("slipstream", pp=4, schedule="gpipe"),
    "pp4-interleaved": Run("slipstream", pp=4, schedule="interleaved", virtual=2),
    "ds-pp4": Run("deepspeed", pp=4),
    "tp2-pp2": Run("slipstream", tp=2, pp=2),
}


# ------------------------------------------------------------------- the model, as layers
def _ds_specs(config: GPTConfig) -> list[Any]:
    """The same layers (slipstream's GPT pipeline layers) as DeepSpeed ``LayerSpec``s."""
    from deepspeed.pipe import LayerSpec

    return [
        LayerSpec(s.typename, *s.module_args, **s.module_kwargs)
        for s in gpt_pipeline_layers(config)
    ]


# ------------------------------------------------------------------------------ one rank
def _micro_batches(
    args: argparse.Namespace, dp_rank: int, dp: int
) -> list[tuple[torch.Tensor, ...]]:
    """This data-parallel rank's share (1/dp) of the step's ``--micro-batches``."""
    gen = torch.Generator().manual_seed(1000 + dp_rank)
    out = []
    for _ in range(args.micro_batches // dp):
        tokens = torch.randint(0, args.vocab, (args.micro, args.seq + 1), generator=gen)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def _ds_config(args: argparse.Namespace, dp: int) -> dict[str, Any]:
    return {
        "train_batch_size": args.micro * args.micro_batches,
        "train_micro_batch_size_per_gpu": args.micro,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {"stage": 1},
        "steps_per_print": 10**9,
    }


def _body(run: Run, args: argparse.Namespace, rank: int, device: torch.device) -> dict[str, Any]:
    world = dist.get_world_size()
    dp = world // (run.tp * run.pp)
    config = GPTConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        max_seq_len=args.seq,
    )
    if run.framework == "deepspeed":
        from benchmarks._peers import _prepare_deepspeed

        _prepare_deepspeed(BenchConfig(world=world, device=device.type))
    import slipstream  # imported before the baseline by every framework alike

    memory = PeakMemory(device)
    torch.manual_seed(0)
    ds_config = _ds_config(args, dp)
    train: Any
    bubble = None
    pipe_engine: Any = None
    if run.framework == "ddp":
        model = GPT(config).to(device)
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
        data = _micro_batches(args, rank, dp)

        def train() -> float:
            for i, (x, y) in enumerate(data):
                if i < len(data) - 1:
                    with ddp.no_sync():
                        (ddp(x, y) / len(data)).backward()
                else:
                    loss = ddp(x, y) / len(data)
                    loss.backward()
            opt.step()
            opt.zero_grad()
            return float(loss) * len(data)

    elif run.framework == "deepspeed":
        import deepspeed
        from deepspeed.pipe import PipelineModule

        module = PipelineModule(
            layers=_ds_specs(config),
            num_stages=run.pp,
            loss_fn=gpt_loss,
            partition_method="parameters",
        )
        engine, *_ = deepspeed.initialize(
            model=module, model_parameters=module.parameters(), config=ds_config
        )
        data = _micro_batches(args, engine.grid.data_parallel_id, dp)

        def train() -> float:
            return float(engine.train_batch(iter(data)))

    elif run.pp > 1:
        from slipstream.pipe import PipelineModule as SPipelineModule

        smodule = SPipelineModule(
            layers=gpt_pipeline_layers(config),
            num_stages=run.pp,
            loss_fn=gpt_loss,
            partition_method="parameters",
            virtual_stages=run.virtual,
        )
        cfg = dict(ds_config, tensor_parallel={"autotp_size": run.tp})
        cfg["zero_optimization"] = {"stage": run.zero, "stage3_param_persistence_threshold": 0}
        cfg["pipeline"] = {"schedule": run.schedule, "virtual_stages": run.virtual}
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-4}}
        sengine, *_ = slipstream.initialize(model=smodule, config=cfg)
        data = _micro_batches(args, dist.get_rank(dp_group(sengine.mesh)), dp)
        bubble = sengine.bubble_fraction()
        pipe_engine = sengine

        def train() -> float:
            return float(sengine.train_batch(iter(data)))

    else:
        cfg = dict(ds_config, tensor_parallel={"autotp_size": run.tp})
        cfg["zero_optimization"] = {"stage": run.zero, "stage3_param_persistence_threshold": 0}
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-4}}
        gengine, *_ = slipstream.initialize(model=GPT(config), config=cfg)
        data = _micro_batches(args, rank // run.tp, dp)

        def train() -> float:
            for x, y in data:
                loss = gengine(x, y)
                gengine.backward(loss)
                gengine.step()
            return float(loss)

    for _ in range(args.warmup):
        train()
    memory.reset_peak()
    times, losses = [], []
    for _ in range(args.steps):
        dist.barrier()
        start = time.perf_counter()
        losses.append(train())
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    peak = max(0, memory.peak_bytes() - memory.baseline)
    return {
        "median_ms": statistics.median(times),
        "peak_mb": peak / _MB,
        "loss": losses[-1],
        "bubble": bubble,
        "busy": None if pipe_engine is None else pipe_engine.last_busy_fraction,
    }


# ---------------------------------------------------------------------------------- driver
def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", default=",".join(RUNS), help="comma list of " + ",".join(RUNS))
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro", type=int, default=2, help="sequences per micro-batch")
    parser.add_argument(
        "--micro-batches", type=int, default=16, help="per step, all dp ranks together"
    )
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    names = [n for n in args.runs.split(",") if n]
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        parser.error(f"unknown runs {unknown}: choose from {', '.join(RUNS)}")
    cfg = BenchConfig(world=args.world, device=args.device, timeout_s=1200)
    results: dict[str, Any] = {}
    for name in names:
        print(f"[bench] {name}", file=sys.stderr)
        outcome = spawn_world(name, cfg, partial(_body, RUNS[name], args))
        if outcome.ok:
            results[name] = {"run": asdict(RUNS[name]), "ranks": outcome.records}
        else:
            results[name] = {"run": asdict(RUNS[name]), "error": outcome.error}
            print(f"[bench] {name} failed: {outcome.error}\n{outcome.detail}", file=sys.stderr)
    print(format_table(results, args))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


def format_table(results: dict[str, Any], args: argparse.Namespace) -> str:
    base = results.get("dp4", {}).get("ranks")
    base_ms = max(r["median_ms"] for r in base) if base else None
    lines = [
        f"GPT h={args.hidden} L={args.layers} seq={args.seq}, world {args.world}, "
        f"{args.micro} x {args.micro_batches} sequences per step (global), fp32, ZeRO-1 "
        "unless named",
        f"{'run':<18} {'step ms':>8} {'vs dp4':>7} {'peak MB/rank (min-max)':>24} "
        f"{'bubble':>7} {'idle':>5} {'loss':>7}",
    ]
    for name, res in results.items():
        if "error" in res:
            lines.append(f"{name:<18} failed: {res['error']}")
            continue
        ranks = res["ranks"]
        ms = max(r["median_ms"] for r in ranks)
        mem = [r["peak_mb"] for r in ranks]
        bubble = next((r["bubble"] for r in ranks if r["bubble"] is not None), None)
        busy = [r["busy"] for r in ranks if r.get("busy") is not None]
        idle = f"{1 - statistics.mean(busy):.2f}" if busy else "-"
        ratio = f"{ms / base_ms:.2f}x" if base_ms else "-"
        lines.append(
            f"{name:<18} {ms:>8.0f} {ratio:>7} {min(mem):>11.0f} - {max(mem):<10.0f} "
            f"{'-' if bubble is None else f'{bubble:.2f}':>7} {idle:>5} {ranks[-1]['loss']:>7.3f}"
        )
    for pair in (("pp2-dp2-1f1b", "ds-pp2-dp2"), ("pp4-1f1b", "ds-pp4")):
        ours, theirs = (results.get(n, {}).get("ranks") for n in pair)
        if ours and theirs:
            t = max(r["median_ms"] for r in ours) / max(r["median_ms"] for r in theirs)
            m = max(r["peak_mb"] for r in ours) / max(max(r["peak_mb"] for r in theirs), 1e-9)
            lines.append(f"{pair[0]} vs {pair[1]}: time {t:.2f}x, peak memory {m:.2f}x")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
