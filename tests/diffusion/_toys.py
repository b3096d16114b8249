"""Shared toy denoisers for the diffusion tests: exact-score Gaussians and a tiny random UNet."""

from __future__ import annotations

import torch

from slipstream.diffusion import NoiseSchedule
from slipstream.models.unet import UNet, UNetConfig


class GaussianMixtureDenoiser:
    """Closed-form ε of a 2-D Gaussian mixture (one component per class, std ``sigma0``).

    ``cond`` holds class indices; index ``len(means)`` is the null label (the whole mixture).
    This is the exact-score toy of the spec (applications.md §3.5).
    """

    def __init__(self, schedule: NoiseSchedule, means: torch.Tensor, sigma0: float = 0.5) -> None:
        self.abar = schedule.alphas_cumprod
        self.means, self.var0 = means.double(), sigma0**2
        self.null = len(means)

    def __call__(self, x: torch.Tensor, t: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        abar = self.abar[t][:, None]
        v = abar * self.var0 + 1 - abar
        centres = abar.sqrt()[:, None] * self.means[None]  # (B, K, 2)
        diff = x.double()[:, None] - centres  # (B, K, 2)
        logw = -(diff**2).sum(-1) / (2 * v)
        onehot = torch.nn.functional.one_hot(cond.clamp(max=self.null - 1), self.null).bool()
        logw = torch.where((cond == self.null)[:, None] | onehot, logw, -torch.inf)
        w = torch.softmax(logw, dim=1)
        eps = (1 - abar).sqrt() * (w[..., None] * diff).sum(1) / v
        return eps.to(x.dtype)


def gaussian_eps(schedule: NoiseSchedule, std: float = 0.5):
    """ε of data ~ N(0, std^2 I): ``sqrt(1 - abar) x / (abar std^2 + 1 - abar)``."""

    def eps(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        abar = schedule.alphas_cumprod[t].to(x.dtype).reshape(-1, *([1] * (x.dim() - 1)))
        return (1 - abar).sqrt() * x / (abar * std**2 + 1 - abar)

    return eps


def tiny_unet(seed: int = 0) -> UNet:
    """An 8x8 UNet with random (non-zero) output weights, so labels change its output."""
    torch.manual_seed(seed)
    unet = UNet(UNetConfig(image_size=8, base_channels=8, channel_mults=(1, 2), num_classes=10))
    torch.nn.init.normal_(unet.conv_out.weight, std=0.1)
    torch.nn.init.normal_(unet.label_emb.weight, std=1.0)
    return unet.eval()


class CallCounter:
    """Wraps a denoiser and records the batch size and conditioning of every call."""

    def __init__(self, denoiser) -> None:
        self.denoiser = denoiser
        self.batch_sizes: list[int] = []

    def __call__(self, x, t, cond):
        self.batch_sizes.append(x.shape[0])
        return self.denoiser(x, t, cond)
