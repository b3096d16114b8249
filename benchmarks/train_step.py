"""Training-step benchmark: slipstream vs DDP, FSDP2 and DeepSpeed on the same GPT and world.

Usage::

    python benchmarks/train_step.py [--world 2] [--preset 25m] [--batch 4] [--seq 256]
        [--steps 10] [--warmup 3] [--frameworks ddp,fsdp2,...] [--json out.json]

Every framework runs in its own fresh world of ``--world`` gloo processes (NCCL with
``--device cuda``); see ``benchmarks/_harness.py`` for how time and memory are measured and
``benchmarks/README.md`` for the DeepSpeed-on-CPU recipe.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks._harness import BenchConfig, FrameworkResult, run_framework, run_interleaved
from benchmarks._peers import PEERS, reference_for
from slipstream.models import GPT, GPTConfig

__all__ = ["build_gpt", "format_table", "gpt_config", "main", "run"]

DEFAULT_FRAMEWORKS = (
    "ddp,fsdp2,fsdp2-noreshard,deepspeed-z0,deepspeed-z1,deepspeed-z2,deepspeed-z3,"
    "slipstream-z0,slipstream-z1,slipstream-z2,slipstream-z3"
)
_MB = 2**20


def gpt_config(preset: str, seq: int) -> GPTConfig:
    """The preset, with ``max_seq_len`` raised to ``seq`` when the preset's is shorter."""
    config = GPTConfig.preset(preset)
    return GPTConfig.preset(preset, max_seq_len=seq) if seq > config.max_seq_len else config


def build_gpt(preset: str, seq: int) -> GPT:
    """The benchmark model (module-level so spawned ranks can unpickle the factory)."""
    return GPT(gpt_config(preset, seq))


def run(
    frameworks: Sequence[str], cfg: BenchConfig, preset: str, log: bool = True, repeats: int = 5
) -> list[FrameworkResult]:
    """Run each framework in its own world, in order; failures are returned, not raised.

    An interleaved row (``slipstream-z2-monitors``) runs ``repeats`` off/on pairs of blocks of
    ``cfg.steps`` steps in its one world."""
    factory = partial(build_gpt, preset, cfg.seq)
    results = []
    for name in frameworks:
        peer = PEERS[name]
        reason = peer.unavailable()
        if log:
            print(f"[bench] {name}: {'skipped' if reason else 'running'}", file=sys.stderr)
        if reason:
            results.append(FrameworkResult(name, error=f"unavailable ({reason})"))
            continue
        if peer.interleaved:
            results.append(run_interleaved(name, peer, cfg, factory, repeats))
        else:
            results.append(run_framework(name, peer, cfg, factory))
    return results


def format_table(results: Sequence[FrameworkResult]) -> str:
    """A text table with ratios: time vs DDP, slipstream-zN time and memory vs deepspeed-zN."""
    by_name = {r.name: r for r in results if r.ok}
    ddp = by_name.get("ddp")
    header = (
        f"{'framework':<16} {'step ms':>8} {'p10-p90 ms':>13} {'tokens/s':>9} "
        f"{'peak MB':>8} {'optim MB':>8} {'loss':>7} {'t/ddp':>6} {'t/ds':>6} {'mem/ds':>6}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        if not r.ok:
            error = r.error or "failed"
            lines.append(f"{r.name:<16} {error[:160]}{'...' if len(error) > 160 else ''}")
            continue
        ref_name = reference_for(r.name)
        ref = by_name.get(ref_name) if ref_name else None
        t_ddp = _ratio(r.median_ms, ddp.median_ms if ddp else None)
        ratios = r.on_off_ratios
        t_ds = (
            f"{statistics.median(ratios):.3f}"
            if ratios
            else _ratio(r.median_ms, ref.median_ms if ref else None)
        )
        m_ds = _ratio(r.peak_mem_bytes, ref.peak_mem_bytes if ref else None)
        spread = f"{r.p10_ms:.0f}-{r.p90_ms:.0f}"
        lines.append(
            f"{r.name:<16} {r.median_ms:>8.1f} {spread:>13} {r.tokens_per_s:>9.0f} "
            f"{r.peak_mem_bytes / _MB:>8.0f} {r.optim_state_bytes / _MB:>8.1f} "
            f"{r.final_loss:>7.4f} {t_ddp:>6} {t_ds:>6} {m_ds:>6}"
        )
    lines += [_interleaved_line(r) for r in results if r.ok and r.on_off_ratios]
    return "\n".join(lines)


def _interleaved_line(r: FrameworkResult) -> str:
    """The spread of an interleaved row: every repeat's on/off ratio, wall and CPU time."""

    def spread(ratios: list[float]) -> str:
        return (
            f"median {statistics.median(ratios):.4f} (min {min(ratios):.4f}, max "
            f"{max(ratios):.4f}; each: {', '.join(f'{x:.3f}' for x in ratios)})"
        )

    return (
        f"{r.name}: on/off over {len(r.on_off_ratios)} interleaved repeats: wall time "
        f"{spread(r.on_off_ratios)}; process CPU time {spread(r.on_off_cpu_ratios)}"
    )


def _ratio(value: float, reference: float | None) -> str:
    return f"{value / reference:.2f}" if reference else "-"


def _environment(cfg: BenchConfig, preset: str) -> dict[str, object]:
    with torch.device("meta"):
        model = GPT(gpt_config(preset, cfg.seq))
    try:
        ds_version = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        ds_version = None
    return {
        "preset": preset,
        "params": model.num_params(),
        "torch": torch.__version__,
        "deepspeed": ds_version,
        "threads_per_rank": max(1, len(_affinity()) // cfg.world),
    }


def _affinity() -> set[int]:
    try:
        return os.sched_getaffinity(0)
    except AttributeError:
        return set(range(os.cpu_count() or 1))


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2, help="ranks per world")
    parser.add_argument("--preset", default="25m", help="GPTConfig preset (tiny, small, 25m)")
    parser.add_argument("--batch", type=int, default=4, help="micro-batch per rank")
    parser.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="interleaved rows (slipstream-z2-monitors): off/on pairs of --steps steps each",
    )
    parser.add_argument("--frameworks", default=DEFAULT_FRAMEWORKS, help="comma-separated")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast / bf16.enabled")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--bucket",
        type=float,
        default=6_553_600,
        help="gradient bucket in elements for all peers (default: DDP's 25 MiB of fp32)",
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per framework")
    parser.add_argument("--json", type=Path, default=None, help="write results here")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.frameworks.split(",") if n.strip()]
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        parser.error(f"unknown framework(s) {unknown}; choose from {', '.join(PEERS)}")
    args.frameworks = names
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    vocab = gpt_config(args.preset, args.seq).vocab_size
    cfg = BenchConfig(
        world=args.world,
        batch=args.batch,
        seq=args.seq,
        steps=args.steps,
        warmup=args.warmup,
        vocab_size=vocab,
        seed=args.seed,
        device=args.device,
        bf16=args.bf16,
        timeout_s=args.timeout,
        bucket=int(args.bucket),
    )
    env = _environment(cfg, args.preset)
    results = run(args.frameworks, cfg, args.preset, repeats=args.repeats)
    print(
        f"GPT {args.preset} ({env['params'] / 1e6:.1f}M params), world {cfg.world} "
        f"({cfg.device}, {env['threads_per_rank']} threads/rank), batch {cfg.batch}x{cfg.seq} "
        f"per rank, {'bf16' if cfg.bf16 else 'fp32'}, {cfg.warmup} warmup + {cfg.steps} timed "
        f"steps, gradient bucket {cfg.bucket:,} elements; torch {env['torch']}, "
        f"deepspeed {env['deepspeed']}"
    )
    print(format_table(results))
    print(
        "peak MB: per-rank peak memory over the timed steps above the pre-model baseline; "
        "t/ddp, t/ds, mem/ds: ratios to ddp and to the deepspeed row of the same ZeRO stage "
        "(slipstream-z2-monitors: TensorBoard + CSV monitors on over off, median over "
        "interleaved repeats in one world, step ms with them on)"
    )
    if args.json:
        payload = {
            "config": cfg.__dict__,
            "env": env,
            "results": [r.to_dict() for r in results],
        }
        args.json.write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
