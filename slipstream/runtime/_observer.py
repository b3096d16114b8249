"""The one small protocol of the engine's observers (``slipstream.runtime.observers``).

An observer watches training without changing it: timers, the FLOPs step profiler, the memory
breakdown, the monitors, the comms logger, the throughput timer and the step line. Each is
built from its config block; the engine holds them in one list and calls every one at the same
points. The base class's methods do nothing, so an observer overrides only what it needs.
``engine`` is the :class:`~slipstream.runtime.engine.Engine` (typed loosely: the engine
imports the observers).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

__all__ = ["EngineObserver"]


class EngineObserver:
    """Hooks the engine calls, in the order of its observer list."""

    def phase(self, engine: Any, name: str) -> AbstractContextManager[None]:
        """A context around the engine's ``forward``, ``backward`` or ``step`` (the optimizer
        step). The list's contexts nest with its first observer innermost."""
        return nullcontext()

    def on_loss(self, engine: Any, loss: torch.Tensor) -> None:
        """A micro-batch's loss as ``backward`` receives it (a pipeline: the batch's mean),
        detached."""

    def on_step(self, engine: Any) -> None:
        """After an optimizer step (skipped or not), with ``global_steps`` and
        ``global_samples`` already counting it."""

    def on_print(self, engine: Any, steps: int, seconds: float) -> str:
        """This observer's part of the step line (``steps_per_print``): it covers the last
        ``steps`` optimizer steps, which took ``seconds``. Empty for nothing."""
        return ""

    def close(self, engine: Any) -> None:
        """``engine.destroy()``: the list is closed last observer first."""
