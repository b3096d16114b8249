"""Wall-clock breakdown of forward, backward and step (``wall_clock_breakdown``)."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from slipstream.accelerator import get_accelerator

__all__ = ["StepTimers"]


class StepTimers:
    """Accumulates seconds per phase between reports; a no-op when disabled."""

    def __init__(self, enabled: bool, device: torch.device) -> None:
        self.enabled = enabled
        self.device = device
        self.totals: dict[str, float] = defaultdict(float)

    def _sync(self) -> None:
        if self.device.type != "cpu":
            get_accelerator().synchronize(self.device.index)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.totals[name] += time.perf_counter() - start

    def report(self, steps: int) -> str:
        """Mean milliseconds per optimizer step of each phase since the last report."""
        parts = [f"{k}={1000 * v / max(steps, 1):.1f}ms" for k, v in self.totals.items()]
        self.totals.clear()
        return " ".join(parts)
