"""The engine's observers: built from the config in the documented order, called at every
phase (nested, first innermost), loss, optimizer step, step line and destroy; a new observer
is one class appended to the list, and a failing close does not stop the others."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any

from tests.distributed.harness import run_world


def observed_run() -> dict[str, Any]:
    import torch
    from torch import nn

    import slipstream
    from slipstream.runtime.observers import EngineObserver

    calls: list[Any] = []

    class Recorder(EngineObserver):
        def __init__(self, tag: str, fail_close: bool = False) -> None:
            self.tag, self.fail_close = tag, fail_close

        @contextmanager
        def phase(self, engine: Any, name: str):  # type: ignore[override]
            calls.append((self.tag, "enter", name))
            yield
            calls.append((self.tag, "exit", name))

        def on_loss(self, engine: Any, loss: torch.Tensor) -> None:
            calls.append((self.tag, "loss", round(float(loss), 6)))

        def on_step(self, engine: Any) -> None:
            calls.append((self.tag, "step", engine.global_steps))

        def on_print(self, engine: Any, steps: int, seconds: float) -> str:
            return f" | {self.tag} over {steps}"

        def close(self, engine: Any) -> None:
            calls.append((self.tag, "close"))
            if self.fail_close:
                raise RuntimeError(f"{self.tag} failed to close")

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("slipstream").addHandler(handler)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "steps_per_print": 2,
        "wall_clock_breakdown": True,
        "memory_breakdown": True,
        "comms_logger": {"enabled": True},
    }
    engine, *_ = slipstream.initialize(model=model, config=config)
    kinds = [type(o).__name__ for o in engine.observers]
    # Inserted before the step line, so the line asks them for their parts.
    at = kinds.index("StepPrinter")
    engine.observers[at:at] = [Recorder("a", fail_close=True), Recorder("b")]
    losses = []
    for _ in range(4):
        loss = engine(torch.ones(2, 4)).pow(2).mean()
        losses.append(round(float(loss), 6))
        engine.backward(loss)
        engine.step()
    try:
        engine.destroy()
        close_error = None
    except RuntimeError as e:
        close_error = str(e)
    logging.getLogger("slipstream").removeHandler(handler)
    return {"kinds": kinds, "calls": calls, "losses": losses, "lines": lines, "error": close_error}


def test_observers_are_built_and_called_in_order() -> None:
    (r,) = run_world(observed_run, 1)
    assert r["kinds"] == [
        "MemoryBreakdown", "StepTimers", "ThroughputTimer", "TrainingEvents", "StepPrinter",
        "CommsLogger",
    ]  # fmt: skip
    calls, losses = r["calls"], r["losses"]
    # One micro-batch: a's phase inside b's (the first observer innermost), loss before backward.
    first = calls[:10]
    assert first == [
        ("b", "enter", "forward"), ("a", "enter", "forward"),
        ("a", "exit", "forward"), ("b", "exit", "forward"),
        ("a", "loss", losses[0]), ("b", "loss", losses[0]),
        ("b", "enter", "backward"), ("a", "enter", "backward"),
        ("a", "exit", "backward"), ("b", "exit", "backward"),
    ]  # fmt: skip
    steps = [c for c in calls if c[1] == "step"]
    assert steps == [("a", "step", 1), ("b", "step", 1), ("a", "step", 2), ("b", "step", 2)]
    assert [c for c in calls if c[1] == "enter" and c[2] == "step"] == [
        ("b", "enter", "step"), ("a", "enter", "step")
    ] * 2  # fmt: skip
    step_lines = [line for line in r["lines"] if line.startswith("step=")]
    assert len(step_lines) == 1 and step_lines[0].startswith("step=2 ")
    assert " | a over 2 | b over 2" in step_lines[0]
    assert " | memory " in step_lines[0] and "forward=" in step_lines[0]
    # Closed last first; a's error comes after every other observer closed.
    assert [c for c in calls if c[1] == "close"] == [("b", "close"), ("a", "close")]
    assert r["error"] == "a failed to close"
    assert any(line.startswith("communication summary (this rank, ") for line in r["lines"])
