"""Classifier-free guidance with per-step schedules and branch skipping (selective guidance).

Classifier-free guidance (CFG; Ho & Salimans 2022, eq. 6) combines an unconditional and a
conditional noise prediction, ``ε̃ = ε_u + s (ε_c - ε_u)``. Run naively it costs two denoiser
evaluations per step; :class:`GuidedDenoiser` runs both branches as *one* batched forward of
``2B`` rows.

Selective guidance (Golnari, Yao & He 2023, arXiv 2305.09847, §2) observes that the last
denoising steps barely need guidance and runs only the conditional branch there (``B`` rows,
``ε̃ = ε_c``): a fraction ``f`` of skipped steps saves about ``f / 2`` of the denoiser compute.
Here a step's *scale* decides its cost: scale ``1`` runs only the conditional branch, scale ``0``
only the unconditional one, anything else both, batched. Schedules are small objects
(:class:`ConstantGuidance`, :class:`SelectiveGuidance`, :class:`CustomGuidance`), so the same hook
also covers guidance in a limited interval (Kynkäänniemi et al. 2024) or CFG only in the first
steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

import torch

__all__ = [
    "ConstantGuidance",
    "CustomGuidance",
    "Denoiser",
    "GuidanceSchedule",
    "GuidanceStats",
    "GuidedDenoiser",
    "SelectiveGuidance",
]

Denoiser = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``denoiser(x_t, t, cond) -> ε``: rows of ``x_t`` (``(B, ...)``), integer timesteps ``t`` of
shape ``(B,)`` and conditioning ``cond`` with ``B`` rows (labels, text embeddings, ...)."""


@runtime_checkable
class GuidanceSchedule(Protocol):
    """Decides the guidance scale of each denoising step.

    ``scale(step, num_steps)`` is called with ``step = 0`` for the noisiest step up to
    ``num_steps - 1``; ``1.0`` means "conditional branch only", ``0.0`` "unconditional only".
    """

    def scale(self, step: int, num_steps: int) -> float: ...


def _check_scale(scale: float, where: str) -> None:
    if not math.isfinite(scale):
        raise ValueError(f"{where}: guidance scale must be finite, got {scale!r}")


@dataclass(frozen=True)
class ConstantGuidance:
    """Plain CFG: the same ``scale`` at every step (the paper's baseline)."""

    scale_value: float = 7.5

    def __post_init__(self) -> None:
        _check_scale(self.scale_value, "ConstantGuidance.scale_value")

    def scale(self, step: int, num_steps: int) -> float:
        return self.scale_value


def skipped_steps(fraction: float, num_steps: int) -> int:
    """``ceil(fraction * num_steps)``, the number of steps a fraction covers (paper §2)."""
    return min(num_steps, math.ceil(fraction * num_steps - 1e-9))


@dataclass(frozen=True)
class SelectiveGuidance:
    """Selective guidance: no unconditional branch in a fraction of the steps (arXiv 2305.09847).

    Attributes:
        scale_value: guidance scale of the guided steps.
        fraction: ``f`` in ``[0, 1]``; ``ceil(f * num_steps)`` steps run the conditional branch
            only (scale 1).
        where: ``"last"`` (the paper: the final, least sensitive steps) or ``"first"`` (for
            comparison: skipping the early steps hurts).
    """

    scale_value: float = 7.5
    fraction: float = 0.2
    where: Literal["last", "first"] = "last"

    def __post_init__(self) -> None:
        _check_scale(self.scale_value, "SelectiveGuidance.scale_value")
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(
                f"SelectiveGuidance.fraction must be in [0, 1], got {self.fraction!r}. "
                f"Fix: e.g. fraction=0.2 skips the unconditional branch in the last 20% of steps"
            )
        if self.where not in ("last", "first"):
            raise ValueError(
                f"SelectiveGuidance.where must be 'last' or 'first', got {self.where!r}"
            )

    def scale(self, step: int, num_steps: int) -> float:
        k = skipped_steps(self.fraction, num_steps)
        skip = step >= num_steps - k if self.where == "last" else step < k
        return 1.0 if skip else self.scale_value


@dataclass(frozen=True)
class CustomGuidance:
    """Any per-step scale: a sequence of ``num_steps`` scales or a ``(step, num_steps)`` callable."""

    scales: Sequence[float] | Callable[[int, int], float]

    def scale(self, step: int, num_steps: int) -> float:
        if callable(self.scales):
            value = float(self.scales(step, num_steps))
        else:
            if len(self.scales) != num_steps:
                raise ValueError(
                    f"CustomGuidance.scales has {len(self.scales)} entries but the sampler runs "
                    f"{num_steps} steps. Fix: give one scale per step, or a callable"
                )
            value = float(self.scales[step])
        _check_scale(value, f"CustomGuidance step {step}")
        return value


@dataclass
class GuidanceStats:
    """What a guided sampling run evaluated.

    Attributes:
        calls: denoiser forward calls.
        rows: rows evaluated in total (the NFE count times the batch size).
        batch_sizes: the batch size of every call, in order.
        modes: per step, ``"both"``, ``"cond"`` or ``"uncond"``.
    """

    calls: int = 0
    rows: int = 0
    batch_sizes: list[int] = field(default_factory=list)
    modes: list[str] = field(default_factory=list)


def _rows(value: torch.Tensor, batch: int, name: str) -> torch.Tensor:
    if value.dim() == 0 or value.shape[0] not in (1, batch):
        raise ValueError(
            f"{name} must have a leading batch dimension of {batch} (the batch of x) or 1, "
            f"got shape {tuple(value.shape)}"
        )
    return value.expand(batch, *value.shape[1:]) if value.shape[0] == 1 else value


class GuidedDenoiser:
    """Turns a conditional ``denoiser`` into the guided ``ε̃`` a sampler consumes.

    ``guided(step, x, t)`` asks ``schedule`` for the step's scale ``s`` and evaluates:

    * ``s == 1``: ``denoiser(x, t, cond)`` only (``B`` rows);
    * ``s == 0``: ``denoiser(x, t, uncond)`` only (``B`` rows);
    * otherwise ``ε_u + s (ε_c - ε_u)`` from one forward of ``2B`` rows (``batched=True``; the
      unconditional half first, as diffusers does) or two forwards of ``B`` rows.

    Args:
        denoiser: a :data:`Denoiser`.
        cond: conditioning rows ``(B, ...)`` (or ``(1, ...)``, broadcast).
        uncond: the unconditional conditioning (null label, empty-prompt embedding), ``B`` or 1 rows.
        schedule: a :class:`GuidanceSchedule`.
        num_steps: the sampler's number of steps (passed to ``schedule.scale``).
        batched: run both branches in one forward (default) or in two.
    """

    def __init__(
        self,
        denoiser: Denoiser,
        cond: torch.Tensor,
        uncond: torch.Tensor,
        schedule: GuidanceSchedule,
        num_steps: int,
        batched: bool = True,
    ) -> None:
        if not isinstance(schedule, GuidanceSchedule):
            raise TypeError(
                f"schedule must have a scale(step, num_steps) method, got {type(schedule).__name__}"
            )
        if tuple(cond.shape[1:]) != tuple(uncond.shape[1:]):
            raise ValueError(
                f"cond and uncond must have the same shape after the batch dimension, got "
                f"{tuple(cond.shape)} and {tuple(uncond.shape)}"
            )
        self.denoiser = denoiser
        self.cond, self.uncond = cond, uncond
        self.schedule, self.num_steps, self.batched = schedule, num_steps, batched
        self.stats = GuidanceStats()

    def _run(self, x: torch.Tensor, t: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        self.stats.calls += 1
        self.stats.rows += x.shape[0]
        self.stats.batch_sizes.append(x.shape[0])
        return self.denoiser(x, t, c)

    def __call__(self, step: int, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Guided noise prediction ``ε̃`` for step ``step`` (``0`` = noisiest) at ``(x, t)``."""
        b = x.shape[0]
        cond, uncond = _rows(self.cond, b, "cond"), _rows(self.uncond, b, "uncond")
        s = float(self.schedule.scale(step, self.num_steps))
        _check_scale(s, f"schedule {type(self.schedule).__name__} at step {step}")
        if s == 1.0:
            self.stats.modes.append("cond")
            return self._run(x, t, cond)
        if s == 0.0:
            self.stats.modes.append("uncond")
            return self._run(x, t, uncond)
        self.stats.modes.append("both")
        if self.batched:
            out = self._run(torch.cat([x, x]), torch.cat([t, t]), torch.cat([uncond, cond]))
            eps_u, eps_c = out.chunk(2)
        else:
            eps_u, eps_c = self._run(x, t, uncond), self._run(x, t, cond)
        return eps_u + s * (eps_c - eps_u)
