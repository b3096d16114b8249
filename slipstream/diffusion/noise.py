"""The variance-preserving noise schedule shared by training and every sampler.

Forward process (DDPM, Ho et al. 2020, eq. 4): ``x_t = sqrt(ᾱ_t) x_0 + sqrt(1 - ᾱ_t) ε`` with
``ᾱ_t = prod_{s<=t} (1 - β_s)`` over ``T`` training timesteps ``0 .. T-1``. Samplers walk a
descending subsequence of those timesteps; the step after the last one goes to ``ᾱ = 1`` (the
clean image), as diffusers' ``set_alpha_to_one=True``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch

__all__ = ["BetaSchedule", "NoiseSchedule", "TimestepSpacing"]

BetaSchedule = Literal["linear", "scaled_linear", "cosine"]
TimestepSpacing = Literal["leading", "trailing", "linspace"]


@dataclass(frozen=True)
class NoiseSchedule:
    """A VP noise schedule: ``β_t`` for ``t = 0 .. num_train_timesteps - 1``.

    Attributes:
        num_train_timesteps: ``T``.
        beta_schedule: ``"linear"`` (DDPM §4: β from ``beta_start`` to ``beta_end``),
            ``"scaled_linear"`` (Stable Diffusion: linear in ``sqrt β``) or ``"cosine"``
            (improved DDPM, Nichol & Dhariwal 2021, eq. 17, β capped at 0.999).
        beta_start: first β of the linear schedules.
        beta_end: last β of the linear schedules.
    """

    num_train_timesteps: int = 1000
    beta_schedule: BetaSchedule = "linear"
    beta_start: float = 1e-4
    beta_end: float = 0.02
    alphas_cumprod: torch.Tensor = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.num_train_timesteps < 2:
            raise ValueError(
                f"NoiseSchedule.num_train_timesteps must be >= 2, got {self.num_train_timesteps}"
            )
        if not 0 < self.beta_start <= self.beta_end < 1:
            raise ValueError(
                f"NoiseSchedule needs 0 < beta_start <= beta_end < 1, got beta_start="
                f"{self.beta_start}, beta_end={self.beta_end}. Fix: e.g. 1e-4 and 0.02"
            )
        betas = self._betas()
        object.__setattr__(self, "alphas_cumprod", torch.cumprod(1.0 - betas, dim=0))

    def _betas(self) -> torch.Tensor:
        n = self.num_train_timesteps
        if self.beta_schedule == "linear":
            return torch.linspace(self.beta_start, self.beta_end, n, dtype=torch.float64)
        if self.beta_schedule == "scaled_linear":
            root = torch.linspace(self.beta_start**0.5, self.beta_end**0.5, n, dtype=torch.float64)
            return root**2
        if self.beta_schedule == "cosine":

            def abar(u: float) -> float:
                return math.cos((u + 0.008) / 1.008 * math.pi / 2) ** 2

            betas = [min(1 - abar((i + 1) / n) / abar(i / n), 0.999) for i in range(n)]
            return torch.tensor(betas, dtype=torch.float64)
        raise ValueError(
            f"NoiseSchedule.beta_schedule must be 'linear', 'scaled_linear' or 'cosine', "
            f"got {self.beta_schedule!r}"
        )

    def alpha_bar(self, t: int) -> float:
        """``ᾱ_t`` as a Python float; ``t < 0`` means the clean image (``ᾱ = 1``)."""
        return 1.0 if t < 0 else float(self.alphas_cumprod[t])

    def add_noise(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Sample ``q(x_t | x_0)``: ``sqrt(ᾱ_t) x0 + sqrt(1 - ᾱ_t) noise`` for a batch of ``t``."""
        abar = self.alphas_cumprod.to(x0.device)[t].to(x0.dtype)
        abar = abar.reshape(-1, *([1] * (x0.dim() - 1)))
        return abar.sqrt() * x0 + (1 - abar).sqrt() * noise

    def timesteps(self, num_steps: int, spacing: TimestepSpacing = "trailing") -> list[int]:
        """A descending list of ``num_steps`` training timesteps for a sampler.

        ``"trailing"`` starts at ``T - 1`` (pure noise; Lin et al. 2024, Table 2) and is the
        default; ``"leading"`` is ``k * (T // num_steps)`` as in Stable Diffusion's DDIM;
        ``"linspace"`` rounds ``linspace(0, T - 1, num_steps)``.

        Raises:
            ValueError: ``num_steps`` is outside ``[1, T]`` or ``spacing`` is unknown.
        """
        n, big_t = num_steps, self.num_train_timesteps
        if not 1 <= n <= big_t:
            raise ValueError(
                f"num_steps must be in [1, {big_t}] (num_train_timesteps), got {num_steps}"
            )
        if spacing == "trailing":
            ts = [round(big_t - k * big_t / n) - 1 for k in range(n)]
        elif spacing == "leading":
            ts = [k * (big_t // n) for k in reversed(range(n))]
        elif spacing == "linspace":
            ts = [round(k * (big_t - 1) / (n - 1)) if n > 1 else 0 for k in reversed(range(n))]
        else:
            raise ValueError(
                f"timestep spacing must be 'trailing', 'leading' or 'linspace', got {spacing!r}"
            )
        return ts
