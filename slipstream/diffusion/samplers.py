"""DDPM, DDIM and DPM-Solver++(2M) samplers over any noise-prediction function.

A sampler walks the descending timesteps ``t_0 > t_1 > ... > t_{N-1}`` of a
:class:`~slipstream.diffusion.noise.NoiseSchedule` and, at step ``i``, asks
``model_fn(i, x, t)`` for the noise ``ε`` (a :class:`~slipstream.diffusion.guidance.GuidedDenoiser`
or any callable); after the last step ``ᾱ = 1``. :func:`guided_sample` wires a denoiser, a
guidance schedule and a sampler together.

All three are deterministic given the initial noise and ``generator`` (DDPM and DDIM with
``eta > 0`` draw fresh noise from it), and keep the dtype and device of the initial noise.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Protocol

import torch

from slipstream.diffusion.guidance import (
    ConstantGuidance,
    Denoiser,
    GuidanceSchedule,
    GuidanceStats,
    GuidedDenoiser,
)
from slipstream.diffusion.noise import NoiseSchedule, TimestepSpacing

__all__ = [
    "DDIMSampler",
    "DDPMSampler",
    "DPMSolverPP2MSampler",
    "ModelFn",
    "SampleResult",
    "Sampler",
    "guided_sample",
    "make_sampler",
]

ModelFn = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]
"""``model_fn(step, x_t, t) -> ε`` with ``t`` a ``(B,)`` long tensor of the step's timestep."""


class Sampler(Protocol):
    """What :func:`guided_sample` needs from a sampler."""

    timesteps: list[int]

    def sample(
        self, model_fn: ModelFn, x: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor: ...


class _BaseSampler:
    """Timesteps, ``ᾱ`` lookup and the ``x_0`` prediction shared by the samplers.

    Args:
        schedule: the training noise schedule.
        num_steps: number of denoising steps (denoiser evaluations per branch).
        spacing: how to pick ``num_steps`` timesteps (:meth:`NoiseSchedule.timesteps`).
        timesteps: explicit strictly descending timesteps; overrides ``num_steps``/``spacing``.
        clip_denoised: clamp the predicted ``x_0`` to ``[-c, c]`` (``None``: no clamp).
    """

    def __init__(
        self,
        schedule: NoiseSchedule,
        num_steps: int = 50,
        *,
        spacing: TimestepSpacing = "trailing",
        timesteps: Sequence[int] | None = None,
        clip_denoised: float | None = None,
    ) -> None:
        self.schedule = schedule
        ts = list(timesteps) if timesteps is not None else schedule.timesteps(num_steps, spacing)
        big_t = schedule.num_train_timesteps
        if not ts or any(a <= b for a, b in pairwise(ts)) or not 0 <= ts[-1] <= ts[0] < big_t:
            raise ValueError(
                f"timesteps must be a non-empty, strictly descending list in [0, {big_t}), got "
                f"{ts[:8]}{'...' if len(ts) > 8 else ''}"
            )
        if clip_denoised is not None and clip_denoised <= 0:
            raise ValueError(f"clip_denoised must be positive or None, got {clip_denoised}")
        self.timesteps = [int(t) for t in ts]
        self.clip_denoised = clip_denoised

    @property
    def num_steps(self) -> int:
        return len(self.timesteps)

    def _alphas(self, i: int) -> tuple[float, float]:
        """``(ᾱ_{t_i}, ᾱ_{t_{i+1}})``, the latter 1 after the last step."""
        nxt = self.timesteps[i + 1] if i + 1 < self.num_steps else -1
        return self.schedule.alpha_bar(self.timesteps[i]), self.schedule.alpha_bar(nxt)

    def _x0(self, x: torch.Tensor, eps: torch.Tensor, abar: float) -> torch.Tensor:
        x0 = (x - (1 - abar) ** 0.5 * eps) / abar**0.5
        if self.clip_denoised is not None:
            x0 = x0.clamp(-self.clip_denoised, self.clip_denoised)
        return x0

    def _eps(self, model_fn: ModelFn, i: int, x: torch.Tensor) -> torch.Tensor:
        t = torch.full((x.shape[0],), self.timesteps[i], dtype=torch.long, device=x.device)
        eps = model_fn(i, x, t)
        if eps.shape != x.shape:
            raise ValueError(
                f"the denoiser returned shape {tuple(eps.shape)} at step {i}, but x has shape "
                f"{tuple(x.shape)}: it must predict the noise ε with the shape of x"
            )
        return eps


def _randn(x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    return torch.randn(x.shape, generator=generator, device=x.device, dtype=x.dtype)


class DDIMSampler(_BaseSampler):
    """DDIM (Song, Meng & Ermon 2021, eq. 12); ``eta = 0`` is deterministic, ``eta = 1`` DDPM-like.

    ``x' = sqrt(abar') x0_hat + sqrt(1 - abar' - s^2) eps + s z`` with
    ``s = eta sqrt((1 - abar') / (1 - abar)) sqrt(1 - abar / abar')`` (eq. 16). With
    ``clip_denoised`` the clamped ``x0_hat`` also re-defines ``eps`` (diffusers'
    ``clip_sample=True, use_clipped_model_output=True``); pixel-space models need it.
    """

    def __init__(
        self,
        schedule: NoiseSchedule,
        num_steps: int = 50,
        *,
        eta: float = 0.0,
        spacing: TimestepSpacing = "trailing",
        timesteps: Sequence[int] | None = None,
        clip_denoised: float | None = None,
    ) -> None:
        super().__init__(
            schedule, num_steps, spacing=spacing, timesteps=timesteps, clip_denoised=clip_denoised
        )
        if eta < 0:
            raise ValueError(f"DDIMSampler eta must be >= 0, got {eta}")
        self.eta = eta

    def sample(
        self, model_fn: ModelFn, x: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        for i in range(self.num_steps):
            eps = self._eps(model_fn, i, x)
            abar, abar_prev = self._alphas(i)
            x0 = self._x0(x, eps, abar)
            if self.clip_denoised is not None:
                # Re-derive ε from the clipped x̂_0 so the two stay consistent (GLIDE; diffusers'
                # use_clipped_model_output): otherwise clipping drifts the image towards grey.
                eps = (x - abar**0.5 * x0) / (1 - abar) ** 0.5
            sigma = self.eta * ((1 - abar_prev) / (1 - abar) * (1 - abar / abar_prev)) ** 0.5
            x = abar_prev**0.5 * x0 + (1 - abar_prev - sigma**2) ** 0.5 * eps
            if sigma > 0:
                x = x + sigma * _randn(x, generator)
        return x


class DDPMSampler(_BaseSampler):
    """Ancestral DDPM sampling (Ho et al. 2020, Alg. 2) over strided timesteps.

    Each step samples the posterior ``q(x_t' | x_t, x0_hat)`` (eq. 6-7) with the step's own
    ``beta = 1 - abar_t / abar_t'`` and the "fixed small" variance
    ``beta (1 - abar_t') / (1 - abar_t)``; the last step returns the posterior mean (no noise).
    ``x0_hat`` is clamped to ``[-1, 1]`` by default (``clip_denoised=1.0``), as in DDPM.
    """

    def __init__(
        self,
        schedule: NoiseSchedule,
        num_steps: int = 50,
        *,
        spacing: TimestepSpacing = "trailing",
        timesteps: Sequence[int] | None = None,
        clip_denoised: float | None = 1.0,
    ) -> None:
        super().__init__(
            schedule, num_steps, spacing=spacing, timesteps=timesteps, clip_denoised=clip_denoised
        )

    def sample(
        self, model_fn: ModelFn, x: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        for i in range(self.num_steps):
            eps = self._eps(model_fn, i, x)
            abar, abar_prev = self._alphas(i)
            x0 = self._x0(x, eps, abar)
            beta = 1 - abar / abar_prev
            c0 = abar_prev**0.5 * beta / (1 - abar)
            ct = (1 - beta) ** 0.5 * (1 - abar_prev) / (1 - abar)
            x = c0 * x0 + ct * x
            if i + 1 < self.num_steps:
                var = (1 - abar_prev) / (1 - abar) * beta
                x = x + var**0.5 * _randn(x, generator)
        return x


class DPMSolverPP2MSampler(_BaseSampler):
    """DPM-Solver++(2M): multistep second-order data-prediction solver (Lu et al. 2022, Alg. 2).

    With ``a = sqrt(abar)``, ``s = sqrt(1 - abar)``, ``lam = log(a / s)`` and
    ``h = lam' - lam``: ``x' = (s' / s) x - a' (exp(-h) - 1) D`` where ``D = x0_hat`` on the
    first step and ``(1 + 1/(2r)) x0_hat - 1/(2r) x0_hat_prev`` (``r = h_prev / h``) after.
    The last step goes to ``s' = 0``; it is first order and returns ``x0_hat`` (as diffusers'
    ``final_sigmas_type="zero"``).
    """

    def sample(
        self, model_fn: ModelFn, x: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        prev_x0: torch.Tensor | None = None
        h_prev = 0.0
        for i in range(self.num_steps):
            eps = self._eps(model_fn, i, x)
            abar, abar_next = self._alphas(i)
            x0 = self._x0(x, eps, abar)
            if abar_next >= 1.0:
                return x0
            h = 0.5 * (math.log(abar_next / (1 - abar_next)) - math.log(abar / (1 - abar)))
            d = x0
            if prev_x0 is not None:
                r = h_prev / h
                d = (1 + 0.5 / r) * x0 - (0.5 / r) * prev_x0
            sigma_ratio = ((1 - abar_next) / (1 - abar)) ** 0.5
            x = sigma_ratio * x - abar_next**0.5 * math.expm1(-h) * d
            prev_x0, h_prev = x0, h
        return x


_SAMPLERS: dict[str, type[_BaseSampler]] = {
    "ddpm": DDPMSampler,
    "ddim": DDIMSampler,
    "dpmpp_2m": DPMSolverPP2MSampler,
}


def make_sampler(
    name: str, schedule: NoiseSchedule, num_steps: int = 50, **kwargs: object
) -> Sampler:
    """Build a sampler by name: ``"ddpm"``, ``"ddim"`` or ``"dpmpp_2m"`` (keyword options pass on)."""
    if name not in _SAMPLERS:
        raise ValueError(f"unknown sampler {name!r}; choose one of {sorted(_SAMPLERS)}")
    return _SAMPLERS[name](schedule, num_steps, **kwargs)  # type: ignore[arg-type]


@dataclass
class SampleResult:
    """Samples and what producing them cost (:class:`GuidanceStats`)."""

    samples: torch.Tensor
    stats: GuidanceStats


@torch.no_grad()
def guided_sample(
    denoiser: Denoiser,
    sampler: Sampler,
    noise: torch.Tensor,
    cond: torch.Tensor,
    uncond: torch.Tensor,
    guidance: GuidanceSchedule | None = None,
    *,
    batched: bool = True,
    generator: torch.Generator | None = None,
) -> SampleResult:
    """Sample with classifier-free guidance under a per-step guidance schedule.

    Args:
        denoiser: ``denoiser(x_t, t, cond) -> ε`` (e.g. :class:`slipstream.models.UNet`, or
            :class:`~slipstream.diffusion.adapters.DiffusersUNetDenoiser`).
        sampler: a DDPM / DDIM / DPM-Solver++ sampler (:func:`make_sampler`).
        noise: the initial ``x_T``, ``(B, ...)``.
        cond: conditioning of the ``B`` samples (or one row, broadcast).
        uncond: the unconditional conditioning (null label / empty prompt), 1 or ``B`` rows.
        guidance: the schedule; default ``ConstantGuidance(7.5)`` (plain CFG).
        batched: run the two branches of a guided step as one forward of ``2B`` rows.
        generator: randomness of stochastic samplers.
    Returns:
        the samples and the :class:`GuidanceStats` (forward calls, rows, batch sizes, modes):
        ``(2 - f) * N * B`` rows for selective guidance skipping a fraction ``f`` of ``N`` steps.
    """
    guided = GuidedDenoiser(
        denoiser, cond, uncond, guidance or ConstantGuidance(), len(sampler.timesteps), batched
    )
    samples = sampler.sample(guided, noise, generator)
    return SampleResult(samples, guided.stats)
