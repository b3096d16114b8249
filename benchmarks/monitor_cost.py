"""What the training monitors cost a step, counted directly rather than as a difference of
two noisy step times: the training thread's time inside the engine's monitor code, and the
CPU time of the threads that write (slipstream's writer and TensorBoard's own).

Usage::

    python benchmarks/monitor_cost.py [--preset tiny] [--batch 2] [--seq 64] [--steps 400]

One process, one CPU thread for torch, the tiny GPT by default (the shortest step, where
the monitors weigh the most); TensorBoard and CSV on. The writer threads' CPU time comes from
``/proc/self/task/<tid>/schedstat`` (nanoseconds on the CPU), so other load on the machine
barely moves it. Their time is counted in full as a cost to the step: it competes with the
training thread for a core or for the GIL. ``benchmarks/train_step.py`` row
``slipstream-z2-monitors`` measures the end-to-end effect (on/off interleaved).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import slipstream
from slipstream.models import GPT, GPTConfig
from slipstream.runtime.observers import TrainingEvents

__all__ = ["main", "measure"]


def _thread_cpu_ns(native_id: int) -> int:
    return int(Path(f"/proc/self/task/{native_id}/schedstat").read_text().split()[0])


def _writer_threads(engine: Any) -> list[int]:
    """Native ids of slipstream's writer thread and of each SummaryWriter's thread."""
    monitor = engine.monitor
    ids = [monitor._thread.native_id]
    for backend in monitor.backends:
        writer = getattr(backend, "writer", None)
        if writer is not None:
            ids.append(writer.file_writer.event_writer._async_writer._worker.native_id)
    return ids


def _timed(fn: Callable[..., Any], spent: list[float]) -> Callable[..., Any]:
    """``fn`` adding the CPU time of its calls (this thread's only: a wake-up of the writer
    that preempts it is counted with the writer) to ``spent[0]``."""

    def wrapper(*args: Any) -> Any:
        start = time.thread_time()
        try:
            return fn(*args)
        finally:
            spent[0] += time.thread_time() - start

    return wrapper


def measure(preset: str, batch: int, seq: int, steps: int) -> dict[str, float]:
    """Microseconds per step: the whole step, the engine's monitor code on the training
    thread, and the writer threads' CPU."""
    torch.set_num_threads(1)
    out = tempfile.mkdtemp(prefix="slipstream-monitor-cost-")
    config = {
        "train_micro_batch_size_per_gpu": batch,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "gradient_clipping": 0.0,
        "tensorboard": {"enabled": True, "output_path": out, "job_name": "tb"},
        "csv_monitor": {"enabled": True, "output_path": out, "job_name": "csv"},
    }
    torch.manual_seed(0)
    engine, *_ = slipstream.initialize(model=GPT(GPTConfig.preset(preset)), config=config)
    x = torch.randint(0, 256, (batch, seq))
    for _ in range(5):  # warm up: first batch handed over, files created
        engine.backward(engine(x, x))
        engine.step()
    engine.monitor.flush()
    spent = [0.0]
    events = next(o for o in engine.observers if isinstance(o, TrainingEvents))
    events.on_loss = _timed(events.on_loss, spent)  # type: ignore[method-assign]
    events.on_step = _timed(events.on_step, spent)  # type: ignore[method-assign]
    threads = _writer_threads(engine)
    cpu_before = sum(_thread_cpu_ns(t) for t in threads)
    start = time.perf_counter()
    for _ in range(steps):
        loss = engine(x, x)
        engine.backward(loss)
        engine.step()
    engine.monitor.flush()  # the writers' work for these steps, all of it
    wall = time.perf_counter() - start
    writer_ns = sum(_thread_cpu_ns(t) for t in threads) - cpu_before
    engine.destroy()
    per_step = 1e6 / steps
    return {
        "step_us": wall * per_step,
        "engine_monitor_us": spent[0] * per_step,
        "writer_cpu_us": writer_ns / 1e3 / steps,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args(argv)
    r = measure(args.preset, args.batch, args.seq, args.steps)
    cost = r["engine_monitor_us"] + r["writer_cpu_us"]
    print(
        f"GPT {args.preset}, batch {args.batch}x{args.seq}, {args.steps} steps, TensorBoard + CSV: "
        f"step {r['step_us']:.0f} us; engine monitor code {r['engine_monitor_us']:.1f} us/step, "
        f"writer threads CPU {r['writer_cpu_us']:.1f} us/step; together {cost:.1f} us/step = "
        f"{100 * cost / r['step_us']:.2f}% of the step"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
