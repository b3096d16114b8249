"""Wall-clock breakdown of forward, backward and step (``wall_clock_breakdown``)."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from slipstream.accelerator import get_accelerator
from slipstream.runtime._observer import EngineObserver

__all__ = ["StepTimers"]


class StepTimers(EngineObserver):
    """Accumulates seconds per phase between step lines (an engine observer)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.totals: dict[str, float] = defaultdict(float)

    def _sync(self) -> None:
        if self.device.type != "cpu":
            get_accelerator().synchronize(self.device.index)

    @contextmanager
    def phase(self, engine: Any, name: str) -> Iterator[None]:
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.totals[name] += time.perf_counter() - start

    def on_print(self, engine: Any, steps: int, seconds: float) -> str:
        return " | " + self.report(steps)

    def report(self, steps: int) -> str:
        """Mean milliseconds per optimizer step of each phase since the last report."""
        parts = [f"{k}={1000 * v / max(steps, 1):.1f}ms" for k, v in self.totals.items()]
        self.totals.clear()
        return " ".join(parts)
