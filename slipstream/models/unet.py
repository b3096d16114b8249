"""A small class-conditional UNet for ε-prediction diffusion (DDPM, Ho et al. 2020, §4 / App. B).

The layout follows the DDPM UNet at toy scale: a sinusoidal timestep embedding passed through an
MLP, residual blocks with GroupNorm that add the (timestep + class) embedding, strided-conv
downsampling, nearest-neighbour upsampling with skip connections, and one self-attention block at
the lowest resolution. A label equal to ``num_classes`` is the *null label* used as the
unconditional branch of classifier-free guidance (Ho & Salimans 2022, §3.2); training drops labels
to it with some probability.

``UNet(x, t, labels)`` has the denoiser signature that ``slipstream.diffusion`` samplers call:
``x`` is ``(B, C, H, W)``, ``t`` integer timesteps ``(B,)`` (or a scalar) and ``labels`` ``(B,)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["UNet", "UNetConfig"]


@dataclass(frozen=True)
class UNetConfig:
    """Shape of a :class:`UNet`.

    Attributes:
        image_size: input height and width; must be divisible by ``2 ** (len(channel_mults) - 1)``.
        in_channels: channels of the input (and, by default, of the predicted noise).
        base_channels: channels of the first level; must be divisible by ``groups``.
        channel_mults: per-level channel multipliers; one downsampling between levels.
        num_res_blocks: residual blocks per level on the way down (one more on the way up).
        num_classes: number of class labels; label ``num_classes`` is the null label.
            ``0`` makes an unconditional model (only the null label is accepted).
        attention: add a self-attention block in the middle (lowest resolution).
        groups: GroupNorm groups.
        dropout: dropout inside residual blocks.
    """

    image_size: int = 16
    in_channels: int = 1
    base_channels: int = 32
    channel_mults: tuple[int, ...] = (1, 2, 2)
    num_res_blocks: int = 1
    num_classes: int = 10
    attention: bool = True
    groups: int = 8
    dropout: float = 0.0

    def __post_init__(self) -> None:
        factor = 2 ** (len(self.channel_mults) - 1)
        if not self.channel_mults or any(m < 1 for m in self.channel_mults):
            raise ValueError(
                f"UNetConfig.channel_mults must be a non-empty tuple of positive ints, got "
                f"{self.channel_mults!r}. Fix: e.g. channel_mults=(1, 2, 2)"
            )
        if self.image_size % factor:
            raise ValueError(
                f"UNetConfig.image_size={self.image_size} is not divisible by {factor} "
                f"(2 ** (len(channel_mults) - 1)). Fix: use an image_size that is a multiple "
                f"of {factor}, or fewer channel_mults"
            )
        if any((self.base_channels * m) % self.groups for m in self.channel_mults):
            raise ValueError(
                f"UNetConfig.base_channels={self.base_channels} times every channel_mult must be "
                f"divisible by groups={self.groups}. Fix: use a multiple of {self.groups}"
            )
        if self.num_classes < 0 or self.num_res_blocks < 1 or not 0 <= self.dropout < 1:
            raise ValueError(
                f"UNetConfig: need num_classes >= 0, num_res_blocks >= 1 and 0 <= dropout < 1, "
                f"got {self.num_classes}, {self.num_res_blocks}, {self.dropout}"
            )


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal embedding of (integer or real) timesteps ``t`` of shape ``(B,)`` -> ``(B, dim)``."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, device=t.device) / half)
    args = t.float()[:, None] * freqs[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    return F.pad(emb, (0, dim % 2))


class _ResBlock(nn.Module):
    def __init__(self, cin: int, cout: int, emb_dim: int, groups: int, dropout: float) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.emb = nn.Linear(emb_dim, 2 * cout)
        self.norm2 = nn.GroupNorm(groups, cout)
        self.drop = nn.Dropout(dropout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        scale, shift = self.emb(F.silu(emb))[:, :, None, None].chunk(2, dim=1)
        h = self.norm2(h) * (1 + scale) + shift  # FiLM-style conditioning (improved DDPM, §3)
        h = self.conv2(self.drop(F.silu(h)))
        return self.skip(x) + h


class _Attention(nn.Module):
    def __init__(self, channels: int, groups: int, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads if channels % heads == 0 else 1
        self.norm = nn.GroupNorm(groups, channels)
        self.qkv = nn.Conv2d(channels, 3 * channels, 1)
        self.out = nn.Conv2d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        q, k, v = self.qkv(self.norm(x)).reshape(b, 3, self.heads, c // self.heads, h * w).unbind(1)
        a = F.scaled_dot_product_attention(
            q.transpose(-1, -2), k.transpose(-1, -2), v.transpose(-1, -2)
        )
        return x + self.out(a.transpose(-1, -2).reshape(b, c, h, w))


class UNet(nn.Module):
    """Small class-conditional UNet predicting the noise ε (see the module docstring)."""

    def __init__(self, config: UNetConfig | None = None) -> None:
        super().__init__()
        self.config = cfg = config or UNetConfig()
        ch, g, drop = cfg.base_channels, cfg.groups, cfg.dropout
        emb_dim = 4 * ch
        self.time_mlp = nn.Sequential(
            nn.Linear(ch, emb_dim), nn.SiLU(), nn.Linear(emb_dim, emb_dim)
        )
        self.label_emb = nn.Embedding(cfg.num_classes + 1, emb_dim)
        self.conv_in = nn.Conv2d(cfg.in_channels, ch, 3, padding=1)

        widths = [ch * m for m in cfg.channel_mults]
        self.down = nn.ModuleList()
        skips, cur = [ch], ch
        for level, width in enumerate(widths):
            for _ in range(cfg.num_res_blocks):
                self.down.append(_ResBlock(cur, width, emb_dim, g, drop))
                cur = width
                skips.append(cur)
            if level < len(widths) - 1:
                self.down.append(nn.Conv2d(cur, cur, 3, stride=2, padding=1))
                skips.append(cur)
        self.mid1 = _ResBlock(cur, cur, emb_dim, g, drop)
        self.mid_attn = _Attention(cur, g) if cfg.attention else nn.Identity()
        self.mid2 = _ResBlock(cur, cur, emb_dim, g, drop)
        self.up = nn.ModuleList()
        for level, width in reversed(list(enumerate(widths))):
            for _ in range(cfg.num_res_blocks + 1):
                self.up.append(_ResBlock(cur + skips.pop(), width, emb_dim, g, drop))
                cur = width
            if level > 0:
                self.up.append(
                    nn.Sequential(nn.Upsample(scale_factor=2.0), nn.Conv2d(cur, cur, 3, padding=1))
                )
        self.norm_out = nn.GroupNorm(g, cur)
        self.conv_out = nn.Conv2d(cur, cfg.in_channels, 3, padding=1)
        nn.init.zeros_(self.conv_out.weight)
        nn.init.zeros_(self.conv_out.bias)

    @property
    def null_label(self) -> int:
        """The label of the unconditional branch (``num_classes``)."""
        return self.config.num_classes

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(
        self, x: torch.Tensor, t: torch.Tensor, labels: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Predict ε for noisy images ``x`` at timesteps ``t`` given ``labels`` (None: null label).

        Raises:
            ValueError: ``x`` has the wrong shape, or a label is outside ``[0, num_classes]``.
        """
        cfg = self.config
        factor = 2 ** (len(cfg.channel_mults) - 1)
        if (
            x.dim() != 4
            or x.shape[1] != cfg.in_channels
            or x.shape[2] % factor
            or x.shape[3] % factor
        ):
            raise ValueError(
                f"UNet input x must be (B, {cfg.in_channels}, H, W) with H and W divisible by "
                f"{factor}, got shape {tuple(x.shape)}"
            )
        b = x.shape[0]
        t = t.reshape(-1).expand(b) if t.numel() == 1 else t
        if labels is None:
            labels = torch.full((b,), cfg.num_classes, dtype=torch.long, device=x.device)
        elif labels.numel() and (int(labels.min()) < 0 or int(labels.max()) > cfg.num_classes):
            raise ValueError(
                f"UNet labels must lie in [0, {cfg.num_classes}] ({cfg.num_classes} is the null "
                f"label), got min {int(labels.min())} max {int(labels.max())}"
            )
        emb = self.time_mlp(timestep_embedding(t, cfg.base_channels)) + self.label_emb(labels)
        h = self.conv_in(x)
        hs = [h]
        for layer in self.down:
            h = layer(h, emb) if isinstance(layer, _ResBlock) else layer(h)
            hs.append(h)
        h = self.mid2(self.mid_attn(self.mid1(h, emb)), emb)
        for layer in self.up:
            if isinstance(layer, _ResBlock):
                h = layer(torch.cat([h, hs.pop()], dim=1), emb)
            else:
                h = layer(h)
        return self.conv_out(F.silu(self.norm_out(h)))
