"""Mixture-of-experts training step: slipstream MoE vs DeepSpeed 0.19.8 MoE vs the dense model.

Usage::

    python benchmarks/moe.py [--world 2] [--hidden 128] [--layers 4] [--experts 8] [--k 2]
        [--batch 4] [--seq 128] [--steps 10] [--warmup 3] [--repeats 3]
        [--rows ds-cap-ep2,ss-cap-ep2,...] [--clock wall|cpu] [--threads N] [--json out.json]

The model is the reference GPT with ``GPTConfig(moe=...)``: every 2nd block's SwiGLU MLP is
an MoE layer of ``--experts`` copies of it, top-``k`` gating. Rows (``ep`` = ``ep_size``):

- ``ds-cap-ep{1,2}`` / ``ss-cap-ep{1,2}``: DeepSpeed's and slipstream's ``MoE`` layer with
  capacity factor 1.0 (tokens over capacity dropped), same weights, same arguments;
- ``ds-nodrop-ep{1,2}`` / ``ss-nodrop-ep{1,2}``: the same with ``drop_tokens=False``;
- ``ss-grouped-ep{1,2}``: slipstream's dropless token-choice layer with grouped experts
  (stacked weights, ``torch._grouped_mm``): equal active parameters, not the same layer;
- ``dense``: the GPT without experts and a ``k`` times wider MLP (equal active parameters),
  on slipstream.

Each row is a fresh world of ``--world`` gloo ranks (``benchmarks/_harness.py``: barrier
before each step, slowest rank's median, peak RSS over the timed steps), ZeRO stage 1,
AdamW, no clipping. The rows run ``--repeats`` times, interleaved (row order rotated each
round), and the table reports per row the median over rounds of the step-time medians; the
machine's load average is printed before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch import nn

from benchmarks._harness import BenchConfig, FrameworkResult, Trainer, run_framework
from benchmarks._peers import Peer, _EngineTrainer, _prepare_deepspeed, _prepare_slipstream
from slipstream.models import GPT, GPTConfig, GPTMoEConfig
from slipstream.models.gpt_moe import MoEFeedForward

__all__ = ["ROWS", "build_model", "main"]

_MB = 2**20


@dataclass(frozen=True)
class Shape:
    hidden: int = 128
    layers: int = 4
    experts: int = 8
    k: int = 2
    seq: int = 128


@dataclass(frozen=True)
class Row:
    framework: str  # "ds" or "ss"
    kind: str  # "cap", "nodrop", "grouped", "dense"
    ep: int


ROWS: dict[str, Row] = {
    **{
        f"{f}-{kind}-ep{ep}": Row(f, kind, ep)
        for f in ("ds", "ss")
        for kind in ("cap", "nodrop")
        for ep in (1, 2)
    },
    **{f"ss-grouped-ep{ep}": Row("ss", "grouped", ep) for ep in (1, 2)},
    "dense": Row("ss", "dense", 1),
}
DEFAULT_ROWS = (
    "ds-cap-ep1,ss-cap-ep1,ds-cap-ep2,ss-cap-ep2,ds-nodrop-ep2,ss-nodrop-ep2,ss-grouped-ep2,dense"
)


def _config(shape: Shape, row: Row) -> GPTConfig:
    base = dict(
        hidden_size=shape.hidden,
        num_layers=shape.layers,
        num_heads=4,
        num_kv_heads=2,
        max_seq_len=shape.seq,
    )
    inter = 64 * -(-8 * shape.hidden // 3 // 64)
    if row.kind == "dense":
        return GPTConfig(**base, intermediate_size=inter * shape.k)  # type: ignore[arg-type]
    moe = GPTMoEConfig(
        num_experts=shape.experts,
        every=2,
        k=shape.k,
        ep_size=row.ep,
        capacity_factor=None if row.kind == "grouped" else 1.0,
        min_capacity=0,
    )
    return GPTConfig(**base, intermediate_size=inter, moe=moe)  # type: ignore[arg-type]


def build_model(shape: Shape, row: Row) -> GPT:
    """The benchmark model of ``row`` (module-level so spawned ranks can unpickle it)."""
    model = GPT(_config(shape, row))
    if row.kind == "nodrop":
        for m in model.modules():
            if isinstance(m, MoEFeedForward):
                m.moe.deepspeed_moe.gate.drop_tokens = False  # type: ignore[union-attr]
    return model


def _to_deepspeed_moe(model: nn.Module) -> None:
    """Swap every slipstream ``MoE`` for DeepSpeed's with the same arguments and weights."""
    from deepspeed.moe.layer import MoE as DSMoE

    for m in model.modules():
        if not isinstance(m, MoEFeedForward):
            continue
        ours = m.moe
        gate = ours.deepspeed_moe.gate  # type: ignore[union-attr]
        expert = ours.deepspeed_moe.experts.deepspeed_experts[0]  # type: ignore[union-attr,index]
        theirs = DSMoE(
            gate.wg.in_features,
            expert,
            num_experts=ours.num_experts,
            ep_size=ours.ep_size,
            k=gate.k,
            capacity_factor=gate.capacity_factor,
            eval_capacity_factor=gate.eval_capacity_factor,
            min_capacity=gate.min_capacity,
            drop_tokens=gate.drop_tokens,
        )
        theirs.load_state_dict(ours.state_dict())
        m.moe = theirs  # type: ignore[assignment]


def _engine_config(cfg: BenchConfig) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": cfg.batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 1, "reduce_bucket_size": cfg.bucket},
        "bf16": {"enabled": cfg.bf16},
    }


def _build_ds(model: nn.Module, cfg: BenchConfig) -> Trainer:
    import deepspeed

    _to_deepspeed_moe(model)
    config = _engine_config(cfg)
    config["optimizer"]["params"]["torch_adam"] = True
    config.update(steps_per_print=10**9, wall_clock_breakdown=False)
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, model_parameters=list(model.parameters()), config=config
    )
    return _EngineTrainer(engine, optimizer)


def _build_ss(model: nn.Module, cfg: BenchConfig) -> Trainer:
    import slipstream

    engine, optimizer, _, _ = slipstream.initialize(
        model=model, model_parameters=model.parameters(), config=_engine_config(cfg)
    )
    return _StatsTrainer(engine, optimizer)


class _StatsTrainer(_EngineTrainer):
    """slipstream's step; the routing statistics are read after the run (dropped tokens)."""


PEERS = {
    "ds": Peer(_build_ds, _prepare_deepspeed),
    "ss": Peer(_build_ss, _prepare_slipstream),
}


def _dropped(shape: Shape, row: Row, cfg: BenchConfig) -> float | None:
    """Fraction of routed choices dropped in one forward of the benchmark batch (one rank,
    ep_size 1 equivalent: capacity is per rank's tokens, as in the world)."""
    if row.kind in ("dense", "grouped"):
        return 0.0 if row.kind == "grouped" else None
    torch.manual_seed(cfg.seed)
    model = build_model(shape, Row(row.framework, row.kind, 1))
    ids = torch.randint(
        0, cfg.vocab_size, (cfg.batch, cfg.seq), generator=torch.Generator().manual_seed(cfg.seed)
    )
    with torch.no_grad():
        model(ids)
    from slipstream.moe import routing_stats

    stats = routing_stats(model)
    drops = [v for key, v in stats.items() if key.endswith("dropped_fraction")]
    return statistics.mean(drops) if drops else None


def run(
    rows: Sequence[str], cfg: BenchConfig, shape: Shape, repeats: int
) -> dict[str, list[FrameworkResult]]:
    out: dict[str, list[FrameworkResult]] = {name: [] for name in rows}
    for rnd in range(repeats):
        order = list(rows[rnd % len(rows) :]) + list(rows[: rnd % len(rows)])
        for name in order:
            row = ROWS[name]
            print(f"[moe] round {rnd + 1}/{repeats}: {name}", file=sys.stderr, flush=True)
            factory = partial(build_model, shape, row)
            result = run_framework(name, PEERS[row.framework], cfg, factory)
            out[name].append(result)
            if result.ok:  # as it comes, so that an interrupted run still reports
                print(
                    f"[moe]   {name}: {result.median_ms:.1f} ms/step, "
                    f"{result.peak_mem_bytes / _MB:.0f} MB peak, loss {result.final_loss:.4f}",
                    file=sys.stderr,
                    flush=True,
                )
            else:
                print(f"[moe]   {name}: {result.error}", file=sys.stderr, flush=True)
    return out


def _summary(results: list[FrameworkResult]) -> dict[str, Any] | None:
    ok = [r for r in results if r.ok]
    if not ok:
        return None
    return {
        "step_ms": statistics.median(r.median_ms for r in ok),
        "step_ms_each": [round(r.median_ms, 1) for r in ok],
        "tokens_per_s": statistics.median(r.tokens_per_s for r in ok),
        "peak_mb": statistics.median(r.peak_mem_bytes for r in ok) / _MB,
        "loss": ok[0].final_loss,
    }


def format_table(results: dict[str, list[FrameworkResult]], shape: Shape, cfg: BenchConfig) -> str:
    summaries = {name: _summary(rs) for name, rs in results.items()}
    header = (
        f"{'row':<15} {'step ms':>8} {'tokens/s':>9} {'peak MB':>8} {'loss':>7} {'dropped':>8} "
        f"{'t ds/ss':>8} {'mem ss/ds':>9} {'t vs dense':>10}  rounds (ms)"
    )
    lines = [header, "-" * len(header)]
    dense = summaries.get("dense")
    for name, s in summaries.items():
        if s is None:
            err = next((r.error for r in results[name] if r.error), "failed")
            lines.append(f"{name:<15} {err}")
            continue
        row = ROWS[name]
        peer = summaries.get("ds-" + name[3:]) if name.startswith("ss-") else None
        speed = f"{peer['step_ms'] / s['step_ms']:.2f}" if peer else "-"
        mem = f"{s['peak_mb'] / peer['peak_mb']:.2f}" if peer else "-"
        vs_dense = f"{s['step_ms'] / dense['step_ms']:.2f}" if dense and name != "dense" else "-"
        drop = _dropped(shape, row, cfg)
        dropped = f"{drop:.3f}" if drop is not None else "-"
        lines.append(
            f"{name:<15} {s['step_ms']:>8.1f} {s['tokens_per_s']:>9.0f} {s['peak_mb']:>8.0f} "
            f"{s['loss']:>7.4f} {dropped:>8} {speed:>8} {mem:>9} {vs_dense:>10}  {s['step_ms_each']}"
        )
    return "\n".join(lines)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rows", default=DEFAULT_ROWS)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: auto)")
    p.add_argument("--json", type=Path)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    rows = [r for r in args.rows.split(",") if r]
    unknown = sorted(set(rows) - ROWS.keys())
    if unknown:
        raise SystemExit(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
    shape = Shape(args.hidden, args.layers, args.experts, args.k, args.seq)
    cfg = BenchConfig(
        world=args.world,
        batch=args.batch,
        seq=args.seq,
        steps=args.steps,
        warmup=args.warmup,
        clock=args.clock,
        threads=args.threads,
    )
    load_before = os.getloadavg()
    results = run(rows, cfg, shape, args.repeats)
    load_after = os.getloadavg()
    print(
        f"MoE step benchmark: world={cfg.world} hidden={shape.hidden} layers={shape.layers} "
        f"experts={shape.experts} k={shape.k} batch={cfg.batch}x{cfg.seq} steps={cfg.steps} "
        f"repeats={args.repeats} clock={cfg.clock} threads/rank={cfg.rank_threads}; "
        f"load average before {load_before[0]:.1f}, after "
        f"{load_after[0]:.1f} on {os.cpu_count()} CPUs"
    )
    print(format_table(results, shape, cfg))
    if args.json:
        args.json.write_text(
            json.dumps({n: _summary(rs) for n, rs in results.items()}, indent=2, default=str)
        )
    return 0 if all(any(r.ok for r in rs) for rs in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
