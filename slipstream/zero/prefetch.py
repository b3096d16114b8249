"""Which ZeRO-3 units to prefetch: the order the previous pass ran them in.

Forward and backward orders are recorded separately, each unit once per pass. While a unit
runs, the units that followed it in the previous pass of the same phase are the candidates
to all-gather ahead of time (the store applies the element budgets). A changed control flow
only costs a useless prefetch, and ranks still agree because they all follow their identical
last order.
"""

from __future__ import annotations

from typing import Literal

__all__ = ["LOOKAHEAD", "Phase", "UnitOrder"]

Phase = Literal["fwd", "bwd"]

LOOKAHEAD = 8  # most units considered for prefetching at each step


class UnitOrder:
    """The unit order of the current and of the previous pass, per phase."""

    def __init__(self) -> None:
        self._current: dict[Phase, list[int]] = {"fwd": [], "bwd": []}
        self._last: dict[Phase, list[int]] = {"fwd": [], "bwd": []}
        self._noted: dict[Phase, set[int]] = {"fwd": set(), "bwd": set()}

    def new_pass(self, phase: Phase) -> None:
        """A pass of ``phase`` begins: the one that just ended becomes the reference."""
        if self._current[phase]:
            self._last[phase] = self._current[phase]
        self._current[phase] = []
        self._noted[phase] = set()

    def note(self, phase: Phase, unit: int) -> list[int]:
        """Record that ``unit`` runs next in ``phase``; return the units that followed it
        last time (up to ``LOOKAHEAD``), or none when ``unit`` already ran in this pass."""
        if unit in self._noted[phase]:
            return []
        self._noted[phase].add(unit)
        current = self._current[phase]
        current.append(unit)
        return self._last[phase][len(current) : len(current) + LOOKAHEAD]
