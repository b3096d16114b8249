"""Where an MoE training step spends its CPU time: forward, backward and optimizer step per
rank, slipstream vs DeepSpeed 0.19.8, beside the plain-PyTorch compute floor.

Usage::

    python benchmarks/moe_phases.py [--rows ss-cap-ep2,ds-cap-ep2] [--steps 10] [--repeats 2]

The rows and the model are those of ``benchmarks/moe.py`` (2 gloo ranks, 1 thread each, ZeRO
stage 1, AdamW). Each phase is timed with the rank process's CPU time (``process_time``: gloo's
threads included) and the calling thread's (``thread_time``); the MoE layers' forward is timed
by hooks. The floor is the same model with ``ep_size`` 1 in one process, forward and backward
with no engine and no communication: the expert rows per rank are those of ``ep_size`` 2, so a
step cannot cost less than the floor plus its optimizer share. Medians over the steps; the
machine's load average is printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
from torch import nn

from benchmarks._harness import BenchConfig, _build_rank, spawn_world, token_batch
from benchmarks.moe import PEERS, ROWS, Row, Shape, build_model

__all__ = ["main"]

_PHASES = ("fwd", "bwd", "step", "thread_fwd", "thread_bwd", "thread_step", "moe_fwd")


def _cfg(steps: int) -> BenchConfig:
    return BenchConfig(world=2, batch=4, seq=128, steps=steps, clock="cpu", threads=1)


def _time_moe_forward(model: nn.Module, sink: list[float]) -> None:
    def pre(m: nn.Module, args: Any) -> None:
        m._phase_t0 = time.thread_time()  # type: ignore[assignment]

    def post(m: nn.Module, args: Any, out: Any) -> None:
        sink.append(time.thread_time() - m._phase_t0)  # type: ignore[operator]

    for m in model.modules():
        if type(m).__name__ == "MOELayer":
            m.register_forward_pre_hook(pre)
            m.register_forward_hook(post)


def _rank(name: str, steps: int, rank: int, device: torch.device) -> dict[str, float]:
    cfg = _cfg(steps)
    row = ROWS[name]
    _, trainer = _build_rank(PEERS[row.framework], cfg, partial(build_model, Shape(), row), device)
    engine = trainer.engine  # type: ignore[attr-defined]
    moe: list[float] = []
    _time_moe_forward(engine.module, moe)
    x, y = token_batch(cfg, rank, device)
    got: dict[str, list[float]] = {p: [] for p in _PHASES}
    for i in range(cfg.warmup + steps):
        dist.barrier()
        moe.clear()
        c0, t0 = time.process_time(), time.thread_time()
        loss = engine(x, y)
        c1, t1 = time.process_time(), time.thread_time()
        engine.backward(loss)
        c2, t2 = time.process_time(), time.thread_time()
        engine.step()
        c3, t3 = time.process_time(), time.thread_time()
        if i < cfg.warmup:
            continue
        for key, value in zip(
            _PHASES, (c1 - c0, c2 - c1, c3 - c2, t1 - t0, t2 - t1, t3 - t2, sum(moe)), strict=True
        ):
            got[key].append(value * 1e3)
    return {key: statistics.median(values) for key, values in got.items()}


def floor(steps: int) -> dict[str, float]:
    """Forward and backward of the ``ep_size`` 1 model in this process, 1 thread, no engine."""
    torch.set_num_threads(1)
    cfg = _cfg(steps)
    torch.manual_seed(cfg.seed)
    model = build_model(Shape(), Row("ss", "cap", 1))
    x, y = token_batch(cfg, 0, torch.device("cpu"))
    fwd, bwd = [], []
    for i in range(cfg.warmup + steps):
        t0 = time.process_time()
        loss = model(x, y)
        t1 = time.process_time()
        loss.backward()
        t2 = time.process_time()
        model.zero_grad(set_to_none=True)
        if i >= cfg.warmup:
            fwd.append((t1 - t0) * 1e3)
            bwd.append((t2 - t1) * 1e3)
    return {"fwd": statistics.median(fwd), "bwd": statistics.median(bwd)}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="ss-cap-ep2,ds-cap-ep2,ss-nodrop-ep2,ds-nodrop-ep2")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    rows = [r for r in args.rows.split(",") if r]
    unknown = sorted(set(rows) - ROWS.keys())
    if unknown or any(ROWS[r].kind in ("dense", "grouped") for r in rows):
        raise SystemExit(f"rows must be among the cap/nodrop rows of benchmarks/moe.py: {rows}")
    print(f"load average before {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    ok = True
    for rnd in range(args.repeats):
        for name in rows:
            out = spawn_world(name, _cfg(args.steps), partial(_rank, name, args.steps))
            if not out.ok:
                print(f"round {rnd + 1} {name}: {out.error}")
                ok = False
                continue
            worst = {k: max(rec[k] for rec in out.records) for k in _PHASES}
            total = worst["fwd"] + worst["bwd"] + worst["step"]
            cells = " ".join(f"{k} {v:.1f}" for k, v in worst.items())
            print(f"round {rnd + 1} {name:<14} total {total:.1f} ms: {cells}")
        fl = floor(args.steps)
        print(
            f"round {rnd + 1} floor (ep_size 1, one process, no engine): fwd {fl['fwd']:.1f} "
            f"bwd {fl['bwd']:.1f} ms"
        )
    print(f"load average after {os.getloadavg()[0]:.1f}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
