"""``memory_breakdown``: where this rank's memory goes, logged with every step line.

At the end of each forward, backward and optimizer step the engine records the accelerator's
allocated and peak-allocated bytes (on CUDA) and the process's resident set size on the host;
every ``steps_per_print`` steps rank 0 logs, for its own rank, the latest value at each
boundary and the peak since the previous line, and the model-state bytes this rank holds
(parameters, gradient accumulators, master weights, optimizer states) next to what
``zero.estimate_memory`` predicts for the same layout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from slipstream.accelerator import get_accelerator, host_rss_bytes
from slipstream.runtime._observer import EngineObserver
from slipstream.zero import ZeroOptimizer

__all__ = ["MemoryBreakdown"]

_MB = 2**20


def _states_per_param(optimizer: ZeroOptimizer) -> int | None:
    """Full-size state tensors per parameter (Adam: 2), None before the first step."""
    for state in optimizer.state.values():
        sizes = [v.numel() for v in state.values() if isinstance(v, torch.Tensor)]
        if sizes:
            return sum(n == max(sizes) for n in sizes)
    return None


@dataclass
class _Point:
    allocated: int = 0
    peak: int = 0
    rss: int = 0


@dataclass
class MemoryBreakdown(EngineObserver):
    """Memory at the step boundaries of one engine (see the module docstring); an engine
    observer."""

    device: torch.device
    estimator: Callable[[int], dict[str, int]] | None = None
    """``zero.estimate_memory`` for this model and layout, given the optimizer's state
    tensors per parameter (counted from the optimizer once it has stepped)."""
    points: dict[str, _Point] = field(default_factory=dict)
    peak_rss: int = 0

    @contextmanager
    def phase(self, engine: Any, name: str) -> Iterator[None]:
        yield
        self.record(name)

    def on_print(self, engine: Any, steps: int, seconds: float) -> str:
        return " | " + self.report(engine.optimizer)

    def record(self, phase: str) -> None:
        """Called by the engine when ``phase`` (forward/backward/step) ends."""
        point = _Point(rss=host_rss_bytes())
        if self.device.type != "cpu":
            acc = get_accelerator()
            point.allocated = acc.memory_allocated(self.device.index)
            point.peak = acc.max_memory_allocated(self.device.index)
        self.points[phase] = point
        self.peak_rss = max(self.peak_rss, point.rss)

    def report(self, optimizer: ZeroOptimizer | None) -> str:
        """One log line: each boundary, the peaks, the model states vs the estimate; resets
        the peaks."""
        parts = []
        for phase, p in self.points.items():
            if self.device.type != "cpu":
                parts.append(
                    f"{phase}: alloc {p.allocated / _MB:.1f} MB peak {p.peak / _MB:.1f} MB "
                    f"rss {p.rss / _MB:.1f} MB"
                )
            else:
                parts.append(f"{phase}: rss {p.rss / _MB:.1f} MB")
        text = "memory " + " | ".join(parts) + f" | peak rss {self.peak_rss / _MB:.1f} MB"
        if optimizer is not None:
            held = optimizer.memory_bytes()
            total = sum(held.values())
            kinds = " + ".join(f"{k} {v / _MB:.2f}" for k, v in held.items())
            text += f" | model states {kinds} = {total / _MB:.2f} MB"
            states = _states_per_param(optimizer)
            if self.estimator is not None and states is not None:
                estimate = self.estimator(states)
                text += f" (ZeRO estimator: {estimate['total'] / _MB:.2f} MB)"
        if self.device.type != "cpu":
            get_accelerator().reset_max_memory_allocated(self.device.index)
        self.peak_rss = 0
        return text
