"""Training a class-conditional diffusion model and a classifier with slipstream's engine.

The diffusion model learns ``ε`` by the simple DDPM loss (Ho et al. 2020, eq. 14) and, for
classifier-free guidance, sees the null label instead of the true one with probability
``label_dropout`` (Ho & Salimans 2022, Alg. 1). Both trainers go through
``slipstream.initialize`` (a world of one process initializes a 1-rank gloo group; under
``slipstream run`` they train data-parallel with the config's ZeRO stage) and keep an exponential
moving average of the diffusion weights, which is what sampling uses.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.diffusion.noise import NoiseSchedule

__all__ = ["ClassifierTrainConfig", "DiffusionTrainConfig", "train_classifier", "train_diffusion"]

logger = logging.getLogger(__name__)

Progress = Callable[[int, float], None]
"""``progress(step, loss)`` called every ``log_every`` steps."""


@dataclass(frozen=True)
class DiffusionTrainConfig:
    """Hyper-parameters of :func:`train_diffusion`.

    Attributes:
        steps: optimizer steps.
        batch_size: global batch size.
        lr: peak AdamW learning rate (cosine decay after ``warmup_steps``).
        warmup_steps: linear warm-up steps.
        label_dropout: probability of replacing a label by the null label (``p_uncond``).
        ema_decay: decay of the weight EMA used for sampling (0 disables it).
        seed: seed of the batch, timestep, noise and dropout draws.
        log_every: call ``progress`` every this many steps (0: never).
        channels_last: train in the channels-last memory format (faster convolutions on CPU).
    """

    steps: int = 2000
    batch_size: int = 128
    lr: float = 2e-3
    warmup_steps: int = 100
    label_dropout: float = 0.1
    ema_decay: float = 0.995
    seed: int = 0
    log_every: int = 0
    channels_last: bool = True

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1 or self.lr <= 0:
            raise ValueError(
                f"DiffusionTrainConfig needs steps >= 1, batch_size >= 1 and lr > 0, got "
                f"{self.steps}, {self.batch_size}, {self.lr}"
            )
        if not 0 <= self.label_dropout < 1 or not 0 <= self.ema_decay < 1:
            raise ValueError(
                f"DiffusionTrainConfig needs 0 <= label_dropout < 1 and 0 <= ema_decay < 1, got "
                f"{self.label_dropout}, {self.ema_decay}"
            )


@dataclass(frozen=True)
class ClassifierTrainConfig:
    """Hyper-parameters of :func:`train_classifier` (random 1-pixel shifts as augmentation)."""

    steps: int = 400
    batch_size: int = 128
    lr: float = 2e-3
    seed: int = 0


@dataclass
class TrainResult:
    """A trained model (the EMA weights for diffusion) and its loss per step."""

    model: nn.Module
    losses: list[float] = field(default_factory=list)


def _engine_config(batch_size: int, lr: float, steps: int, warmup: int) -> dict[str, Any]:
    return {
        "train_batch_size": batch_size,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0}},
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {"total_num_steps": steps, "warmup_num_steps": min(warmup, steps)},
        },
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
    }


def _check_data(images: torch.Tensor, labels: torch.Tensor) -> None:
    if images.dim() != 4 or labels.shape != images.shape[:1]:
        raise ValueError(
            f"images must be (N, C, H, W) and labels (N,), got {tuple(images.shape)} and "
            f"{tuple(labels.shape)}"
        )


def train_diffusion(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    null_label: int,
    schedule: NoiseSchedule,
    config: DiffusionTrainConfig | None = None,
    progress: Progress | None = None,
) -> TrainResult:
    """Train ``model(x_t, t, labels) -> ε`` on ``images`` with label dropout; return its EMA copy.

    Args:
        model: the denoiser (e.g. :class:`slipstream.models.UNet`); trained in place.
        images: ``(N, C, H, W)`` training images in ``[-1, 1]``.
        labels: ``(N,)`` class labels.
        null_label: the label of the unconditional branch.
        schedule: the forward-process noise schedule.
        config: hyper-parameters (default :class:`DiffusionTrainConfig`).
        progress: optional ``progress(step, loss)`` callback.
    Returns:
        :class:`TrainResult` with the EMA model in eval mode (the trained model itself if
        ``ema_decay == 0``) and the per-step losses.
    """
    from slipstream.runtime.initialize import initialize

    cfg = config or DiffusionTrainConfig()
    _check_data(images, labels)
    fmt = (
        torch.channels_last if cfg.channels_last and images.dim() == 4 else torch.contiguous_format
    )
    model.to(memory_format=fmt)
    ema = copy.deepcopy(model).eval().requires_grad_(False) if cfg.ema_decay > 0 else None
    engine, _, _, _ = initialize(
        model=model, config=_engine_config(cfg.batch_size, cfg.lr, cfg.steps, cfg.warmup_steps)
    )
    device = engine.device
    images, labels = images.to(device).contiguous(memory_format=fmt), labels.to(device)
    gen = torch.Generator(device="cpu").manual_seed(cfg.seed)
    micro = engine.train_micro_batch_size_per_gpu()
    losses: list[float] = []
    engine.train()
    for step in range(cfg.steps):
        for _ in range(engine.gradient_accumulation_steps()):
            idx = torch.randint(0, len(images), (micro,), generator=gen).to(device)
            y = labels[idx].clone()
            y[(torch.rand(micro, generator=gen) < cfg.label_dropout).to(device)] = null_label
            t = torch.randint(0, schedule.num_train_timesteps, (micro,), generator=gen).to(device)
            noise = torch.randn(images[idx].shape, generator=gen).to(device)
            loss = F.mse_loss(engine(schedule.add_noise(images[idx], noise, t), t, y), noise)
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())
        if ema is not None:
            # EMA warm-up (decay (1 + n) / (10 + n)) so short runs are not dominated by the init.
            decay = min(cfg.ema_decay, (1 + step) / (10 + step))
            with torch.no_grad():
                torch._foreach_lerp_(
                    list(ema.parameters()), list(engine.module.parameters()), 1 - decay
                )
        if progress is not None and cfg.log_every and (step + 1) % cfg.log_every == 0:
            progress(step + 1, sum(losses[-cfg.log_every :]) / cfg.log_every)
    engine.eval()
    return TrainResult(ema if ema is not None else model, losses)


def _shift(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Random translation by up to one pixel (pads with the background value -1)."""
    padded = F.pad(x, (1, 1, 1, 1), value=-1.0)
    dy, dx = torch.randint(0, 3, (2,), generator=gen).tolist()
    return padded[..., dy : dy + x.shape[-2], dx : dx + x.shape[-1]]


def train_classifier(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    config: ClassifierTrainConfig | None = None,
) -> TrainResult:
    """Train a classifier with cross-entropy through slipstream's engine; returns it in eval mode."""
    from slipstream.runtime.initialize import initialize

    cfg = config or ClassifierTrainConfig()
    _check_data(images, labels)
    engine, _, _, _ = initialize(
        model=model, config=_engine_config(cfg.batch_size, cfg.lr, cfg.steps, cfg.steps // 10)
    )
    images, labels = images.to(engine.device), labels.to(engine.device)
    gen = torch.Generator(device="cpu").manual_seed(cfg.seed)
    micro = engine.train_micro_batch_size_per_gpu()
    losses: list[float] = []
    engine.train()
    for _ in range(cfg.steps):
        for _ in range(engine.gradient_accumulation_steps()):
            idx = torch.randint(0, len(images), (micro,), generator=gen).to(engine.device)
            loss = F.cross_entropy(engine(_shift(images[idx], gen)), labels[idx])
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())
    engine.eval()
    model.eval()
    logger.debug("classifier trained: final loss %.4f", losses[-1])
    return TrainResult(model, losses)
