"""What expert parallelism adds to one MoE layer: forward + backward CPU time at ``ep_size`` 2
against the same layer at ``ep_size`` 1 on one rank's tokens.

Usage::

    python benchmarks/moe_layer.py [--kind cap|nodrop] [--steps 40] [--repeats 3]

The layer is the first MoE MLP of ``benchmarks/moe.py``'s GPT (hidden 128, 8 SwiGLU experts,
top-2), on a ``[4, 128, 128]`` input per rank, with no engine around it. At ``ep_size`` 2
(2 gloo ranks, 1 thread each) each rank computes its 4 experts on the rows both ranks send
it; at ``ep_size`` 1 one process computes all 8 experts on one rank's tokens: about the same
expert rows. So the difference is what dispatch, the all-to-alls and the regrouping cost.
Each step is timed with the process's CPU time (``process_time``: gloo's threads included)
and the calling thread's (``thread_time``); medians over the steps, then per rank. The
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
from torch import nn

from benchmarks._harness import BenchConfig, spawn_world
from benchmarks.moe import Row, Shape, build_model
from slipstream.models.gpt_moe import MoEFeedForward

__all__ = ["main"]

_WARMUP = 5


def _layer(kind: str, ep: int) -> tuple[nn.Module, MoEFeedForward]:
    torch.manual_seed(0)
    model = build_model(Shape(), Row("ss", kind, ep))
    return model, next(m for m in model.modules() if isinstance(m, MoEFeedForward))


def _time(layer: MoEFeedForward, x: torch.Tensor, steps: int) -> dict[str, float]:
    proc, thread = [], []
    for i in range(_WARMUP + steps):
        if dist.is_initialized():
            dist.barrier()
        c0, t0 = time.process_time(), time.thread_time()
        out = layer(x)
        assert layer.aux_loss is not None
        (out.float().square().mean() + layer.aux_loss).backward()
        c1, t1 = time.process_time(), time.thread_time()
        if i >= _WARMUP:
            proc.append((c1 - c0) * 1e3)
            thread.append((t1 - t0) * 1e3)
    return {"process": statistics.median(proc), "thread": statistics.median(thread)}


def _input(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    return torch.randn(4, 128, Shape().hidden, generator=g, requires_grad=True)


def _rank(kind: str, steps: int, rank: int, device: torch.device) -> dict[str, float]:
    from slipstream.moe import expert_parallel_

    model, layer = _layer(kind, 2)
    expert_parallel_(model, None)
    return _time(layer, _input(rank), steps)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kind", choices=("cap", "nodrop"), default="cap")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    cfg = BenchConfig(world=2, batch=4, seq=128, steps=args.steps, clock="cpu", threads=1)
    print(f"load average before {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    torch.set_num_threads(1)
    ok = True
    for rnd in range(args.repeats):
        out = spawn_world(f"moe-layer-{args.kind}", cfg, partial(_rank, args.kind, args.steps))
        if not out.ok:
            print(f"round {rnd + 1}: {out.error}")
            ok = False
            continue
        _, layer = _layer(args.kind, 1)
        one = _time(layer, _input(0), args.steps)
        ep2 = " ".join(
            f"rank {r} {rec['process']:.2f}/{rec['thread']:.2f}"
            for r, rec in enumerate(out.records)
        )
        print(
            f"round {rnd + 1} {args.kind}: ep_size 2 process/thread ms {ep2}; "
            f"ep_size 1 {one['process']:.2f}/{one['thread']:.2f}"
        )
    print(f"load average after {os.getloadavg()[0]:.1f}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
