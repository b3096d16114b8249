"""A ViT encoder with a light per-token decoder: the segmenter of adaptive patching (APF).

Input is a sequence of L tokens of C x P x P pixels -- uniform ViT patches or the adaptive
quadtree tokens of :mod:`slipstream.vision` -- and the output is P x P mask logits per token,
in the same order. The same weights serve both, which is how APF stays a pure preprocessing
step (Zhang et al., SC24, arXiv 2404.09707, sec. III-B: an unmodified ViT on the token
"strip"; ViT: Dosovitskiy et al., ICLR 2021, sec. 3.1).

* Patch embedding: one linear map of the flattened C*P*P token. This is exactly the stock
  ViT ``Conv2d(C, d, kernel_size=P, stride=P)`` applied to the P x (L*P) strip of tokens.
* Positions (``position``): "slot" adds a learned embedding per sequence slot, as in the
  released model; "geometry" adds a 2-D sinusoidal embedding of the leaf centre plus a learned
  embedding of the leaf depth log2(R/s); "slot+geometry" adds both; "none" adds nothing.
* Encoder: pre-norm transformer blocks (LayerNorm, multi-head attention, GELU MLP); padding
  tokens are masked out as attention keys.
* Decoder: per token, a linear map to ``decoder_channels`` maps of P x P, concatenated with
  the token's own pixels, then 3x3 and 1x1 convolutions (a light UNETR-like head at one scale).

Module names: ``patch_embed``, ``pos_slot``, ``depth_embed``, ``blocks.{i}.{norm1,attn.qkv,
attn.proj,norm2,mlp.fc1,mlp.fc2}``, ``norm``, ``head.{proj,conv,out}``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from slipstream.config._errors import ConfigError

__all__ = ["ViTSegConfig", "ViTSegmenter"]

Position = Literal["slot", "geometry", "slot+geometry", "none"]

_PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=2),  # tests
    "small": dict(hidden_size=192, num_layers=6, num_heads=3),  # ViT-Ti width
    "base": dict(hidden_size=768, num_layers=12, num_heads=12),  # ViT-B, the paper's class
}


@dataclass
class ViTSegConfig:
    """Shape of a :class:`ViTSegmenter`. Validated at construction."""

    patch_size: int = 8
    """P: tokens are P x P pixels; the head predicts P x P logits per token."""
    in_channels: int = 3
    """C: channels per token pixel."""
    hidden_size: int = 192
    """Width d of the residual stream (a multiple of num_heads, and of 4 for geometry)."""
    num_layers: int = 6
    """Transformer blocks."""
    num_heads: int = 3
    """Attention heads."""
    mlp_ratio: float = 4.0
    """MLP hidden width = mlp_ratio * hidden_size."""
    max_tokens: int = 1024
    """Longest sequence (size of the slot table)."""
    position: Position = "slot"
    """Positional information: "slot", "geometry", "slot+geometry" or "none" (module doc)."""
    max_depth: int = 16
    """Deepest leaf (log2(R / s)) the depth embedding covers."""
    decoder_channels: int = 16
    """Feature maps per token in the decoder head."""
    dropout: float = 0.0
    """Dropout on attention probabilities and residual branches, in [0, 1)."""

    def __post_init__(self) -> None:
        for name in ("patch_size", "in_channels", "hidden_size", "num_layers", "num_heads",
                     "max_tokens", "decoder_channels"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ConfigError(f"ViTSegConfig.{name}={getattr(self, name)} must be >= 1")
        if self.hidden_size % self.num_heads:
            raise ConfigError(
                f"ViTSegConfig.hidden_size={self.hidden_size} is not divisible by "
                f"num_heads={self.num_heads}; pick a multiple of num_heads"
            )
        if self.position not in ("slot", "geometry", "slot+geometry", "none"):
            raise ConfigError(
                f"ViTSegConfig.position={self.position!r} is unknown; use 'slot', 'geometry', "
                "'slot+geometry' or 'none'"
            )
        if "geometry" in self.position and self.hidden_size % 4:
            raise ConfigError(
                f"ViTSegConfig.hidden_size={self.hidden_size} must be a multiple of 4 for "
                "position='geometry' (sin/cos of two coordinates)"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"ViTSegConfig.dropout={self.dropout} must be in [0, 1)")

    @classmethod
    def preset(cls, name: str, **overrides: object) -> ViTSegConfig:
        """ "tiny" (d=64, 2 layers), "small" (d=192, 6 layers), "base" (ViT-B: 768, 12)."""
        if name not in _PRESETS:
            raise ConfigError(f"unknown ViTSegConfig preset {name!r}; use one of {list(_PRESETS)}")
        unknown = sorted(set(overrides) - {f.name for f in fields(cls)})
        if unknown:
            raise ConfigError(f"unknown ViTSegConfig field(s) {unknown} in preset overrides")
        return replace(cls(**_PRESETS[name]), **overrides)  # type: ignore[arg-type]


class _Attention(nn.Module):
    def __init__(self, cfg: ViTSegConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.dropout = cfg.dropout

    def forward(self, x: Tensor, key_mask: Tensor | None) -> Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        drop = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, dropout_p=drop)
        return self.proj(y.transpose(1, 2).reshape(b, n, d))


class _Block(nn.Module):
    def __init__(self, cfg: ViTSegConfig) -> None:
        super().__init__()
        d, hidden = cfg.hidden_size, int(cfg.mlp_ratio * cfg.hidden_size)
        self.norm1 = nn.LayerNorm(d)
        self.attn = _Attention(cfg)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential()
        self.mlp.add_module("fc1", nn.Linear(d, hidden))
        self.mlp.add_module("act", nn.GELU())
        self.mlp.add_module("fc2", nn.Linear(hidden, d))
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor, key_mask: Tensor | None) -> Tensor:
        x = x + self.drop(self.attn(self.norm1(x), key_mask))
        return x + self.drop(self.mlp(self.norm2(x)))


class _TokenDecoder(nn.Module):
    """Features (B, L, d) + token pixels (B, L, C, P, P) -> logits (B, L, P, P)."""

    def __init__(self, cfg: ViTSegConfig) -> None:
        super().__init__()
        c, p = cfg.decoder_channels, cfg.patch_size
        self.channels, self.patch = c, p
        self.proj = nn.Linear(cfg.hidden_size, c * p * p)
        self.conv = nn.Conv2d(c + cfg.in_channels, c, kernel_size=3, padding=1)
        self.out = nn.Conv2d(c, 1, kernel_size=1)

    def forward(self, feats: Tensor, tokens: Tensor) -> Tensor:
        b, n, _ = feats.shape
        p = self.patch
        maps = self.proj(feats).view(b * n, self.channels, p, p)
        x = torch.cat([maps, tokens.reshape(b * n, -1, p, p)], dim=1)
        return self.out(F.gelu(self.conv(x))).view(b, n, p, p)


def _sincos(coord: Tensor, dim: int) -> Tensor:
    """Sinusoidal features of coordinates in [0, 1] (in units of 1/1024 of the image)."""
    freqs = torch.exp(
        -math.log(10000.0)
        * torch.arange(dim // 2, device=coord.device, dtype=torch.float32)
        / (dim // 2)
    )
    angle = (coord.float() * 1024.0).unsqueeze(-1) * freqs
    return torch.cat([angle.sin(), angle.cos()], dim=-1)


class ViTSegmenter(nn.Module):
    """ViT encoder + per-token decoder: (B, L, C, P, P) tokens -> (B, L, P, P) mask logits."""

    def __init__(self, config: ViTSegConfig) -> None:
        super().__init__()
        self.config = cfg = config
        d = cfg.hidden_size
        self.patch_embed = nn.Linear(cfg.in_channels * cfg.patch_size**2, d)
        self.pos_slot = nn.Parameter(torch.zeros(1, cfg.max_tokens, d))
        self.depth_embed = (
            nn.Embedding(cfg.max_depth + 1, d) if "geometry" in cfg.position else None
        )
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.LayerNorm(d)
        self.head = _TokenDecoder(cfg)
        self.apply(self._init)
        nn.init.trunc_normal_(self.pos_slot, std=0.02)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.trunc_normal_(m.weight, std=0.02)

    def num_params(self) -> int:
        """Number of parameters."""
        return sum(p.numel() for p in self.parameters())

    def _check(self, tokens: Tensor, valid: Tensor | None, geometry: Tensor | None) -> None:
        c = self.config
        want = (c.in_channels, c.patch_size, c.patch_size)
        if tokens.dim() != 5 or tuple(tokens.shape[2:]) != want:
            raise ValueError(
                f"tokens must have shape (batch, L, {want[0]}, {want[1]}, {want[2]}), got "
                f"{tuple(tokens.shape)}; check patch_size / in_channels of the config"
            )
        if tokens.shape[1] > c.max_tokens:
            raise ValueError(
                f"tokens has L={tokens.shape[1]} > max_tokens={c.max_tokens}; raise "
                "ViTSegConfig.max_tokens"
            )
        if valid is not None and valid.shape != tokens.shape[:2]:
            raise ValueError(
                f"valid must have shape {tuple(tokens.shape[:2])}, got {tuple(valid.shape)}"
            )
        if "geometry" in c.position and (
            geometry is None or geometry.shape != (*tokens.shape[:2], 3)
        ):
            raise ValueError(
                f"position={c.position!r} needs geometry of shape (batch, L, 3) (PatchBatch."
                f"geometry), got {None if geometry is None else tuple(geometry.shape)}"
            )

    def embed(self, tokens: Tensor, geometry: Tensor | None = None) -> Tensor:
        """Token + positional embeddings, (B, L, d)."""
        b, n = tokens.shape[:2]
        x = self.patch_embed(tokens.reshape(b, n, -1))
        pos = self.config.position
        if "slot" in pos:
            x = x + self.pos_slot[:, :n]
        if "geometry" in pos:
            assert geometry is not None and self.depth_embed is not None
            quarter = self.config.hidden_size // 2
            centre = torch.cat(
                [_sincos(geometry[..., 0], quarter), _sincos(geometry[..., 1], quarter)], -1
            )
            depth = geometry[..., 2].long().clamp(0, self.config.max_depth)
            x = x + centre.to(x.dtype) + self.depth_embed(depth)
        return x

    def forward(
        self, tokens: Tensor, valid: Tensor | None = None, geometry: Tensor | None = None
    ) -> Tensor:
        """Mask logits per token.

        Args:
            tokens: (B, L, C, P, P) pixel tokens.
            valid: (B, L) bool, False at padding tokens (ignored as attention keys); None if
                every token is real. Every row needs at least one valid token.
            geometry: (B, L, 3) leaf centre row, column (fractions of R) and depth; needed
                when ``position`` includes "geometry" (``PatchBatch.geometry``).

        Returns:
            (B, L, P, P) logits. Cost per layer: O(L * d**2 + L**2 * d).
        """
        self._check(tokens, valid, geometry)
        x = self.embed(tokens, geometry)
        key_mask = None if valid is None or bool(valid.all()) else valid[:, None, None, :]
        for block in self.blocks:
            x = block(x, key_mask)
        return self.head(self.norm(x), tokens)
