"""Fake quantizers of DeepSpeed's compression library, with the straight-through estimator.

Each function returns the dequantized tensor (same shape and dtype as its input), so a layer
computes with the values the quantized model will hold; the gradient passes through unchanged
(straight-through estimator, as in quantization-aware training, ZeroQuant arXiv:2206.01861
sec. 3). The arithmetic follows DeepSpeed 0.19.8 step for step (the same divisions, rounding
and clamping, in the same order) so a forward is bit-for-bit DeepSpeed's on the same backend.

Grouping: the tensor is flattened and split into ``num_groups`` equal contiguous runs, each
with its own range (rows of a weight when ``num_groups`` is its row count; tokens of an
activation when it is ``numel // hidden``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = [
    "asymmetric_quantize",
    "binary_quantize",
    "quantize_weight",
    "symmetric_quantize",
    "ternary_quantize",
    "topk_mask",
]


def _symmetric(
    x: torch.Tensor,
    bits: int,
    lo: torch.Tensor | None,
    hi: torch.Tensor | None,
    num_groups: int,
) -> torch.Tensor:
    levels = 2**bits
    if lo is None or hi is None:
        flat = x.reshape(num_groups, -1)
        absmax = torch.amax(torch.abs(flat), dim=-1).view(num_groups, -1)
    else:
        flat = x
        absmax = torch.max(lo.abs(), hi).view(-1)
    scale = 2 * absmax / levels
    out = (flat / scale).round().clamp(-levels // 2, levels // 2 - 1) * scale
    return out.reshape(x.shape).contiguous()


def _asymmetric(
    x: torch.Tensor,
    bits: int,
    lo: torch.Tensor | None,
    hi: torch.Tensor | None,
    num_groups: int,
) -> torch.Tensor:
    levels = 2**bits
    flat = x
    if lo is None or hi is None:
        flat = x.reshape(num_groups, -1)
        lo = flat.amin(dim=-1, keepdim=True)
        hi = flat.amax(dim=-1, keepdim=True)
    scale = (hi - lo) / levels
    zero = (lo / scale).round() * scale
    out = ((flat - zero) / scale).round().clamp(0, levels - 1) * scale + zero
    return out.reshape(x.shape).contiguous()


def _ternary(x: torch.Tensor, num_groups: int) -> torch.Tensor:
    # TWN (Li et al. 2016): threshold 0.7 x mean |w|, one scale = mean |w| above it.
    flat = x.reshape(num_groups, -1)
    mean_abs = flat.norm(p=1, dim=1).div(flat.shape[1])
    threshold = (0.7 * mean_abs).view(-1, 1)
    pos = (flat > threshold).to(x.dtype)
    neg = (flat < -threshold).to(x.dtype)
    kept = (flat.abs() > threshold).to(x.dtype)
    alpha = ((kept * flat).abs().sum(dim=1) / kept.sum(dim=1)).view(-1, 1)
    return (alpha * pos - alpha * neg).reshape(x.shape).contiguous()


def _binary(x: torch.Tensor, num_groups: int) -> torch.Tensor:
    # BWN (Rastegari et al. 2016): sign times mean |w| of the group.
    flat = x.reshape(num_groups, -1)
    mean_abs = flat.norm(p=1, dim=1, keepdim=True).div(flat.shape[1])
    return flat.sign().mul(mean_abs).reshape(x.shape).contiguous()


class _StraightThrough(torch.autograd.Function):
    """Forward: a quantizer; backward: the identity for the input, nothing for the rest."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fn: Any, *args: Any) -> torch.Tensor:
        ctx.n_extra = len(args) + 1
        return fn(x, *args)  # type: ignore[no-any-return]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (grad.clone(),) + (None,) * ctx.n_extra


def symmetric_quantize(
    x: torch.Tensor,
    bits: int,
    lo: torch.Tensor | None = None,
    hi: torch.Tensor | None = None,
    num_groups: int = 1,
) -> torch.Tensor:
    """Symmetric uniform quantization to ``bits`` (2^bits levels, scale = 2 absmax / 2^bits).

    ``lo``/``hi``: a fixed range (static activation ranges; then ``num_groups`` must be 1);
    otherwise each group's own absmax. An all-zero group gives NaN, as in DeepSpeed.
    """
    return _StraightThrough.apply(x, _symmetric, bits, lo, hi, num_groups)  # type: ignore[no-any-return]


def asymmetric_quantize(
    x: torch.Tensor,
    bits: int,
    lo: torch.Tensor | None = None,
    hi: torch.Tensor | None = None,
    num_groups: int = 1,
) -> torch.Tensor:
    """Asymmetric uniform quantization: scale = (max - min) / 2^bits, a rounded zero point."""
    return _StraightThrough.apply(x, _asymmetric, bits, lo, hi, num_groups)  # type: ignore[no-any-return]


def ternary_quantize(x: torch.Tensor, num_groups: int = 1) -> torch.Tensor:
    """Ternary {-a, 0, a} per group (2-bit weights)."""
    return _StraightThrough.apply(x, _ternary, num_groups)  # type: ignore[no-any-return]


def binary_quantize(x: torch.Tensor, num_groups: int = 1) -> torch.Tensor:
    """Binary {-a, a} per group (1-bit weights)."""
    return _StraightThrough.apply(x, _binary, num_groups)  # type: ignore[no-any-return]


def quantize_weight(w: torch.Tensor, bits: int, kind: str, num_groups: int) -> torch.Tensor:
    """A weight at ``bits``: uniform (``kind`` symmetric/asymmetric) from 3 bits, ternary at 2,
    binary at 1 (those two are symmetric only; the config refuses asymmetric)."""
    if bits >= 3:
        quant = symmetric_quantize if kind == "symmetric" else asymmetric_quantize
        return quant(w, bits, None, None, num_groups)
    if bits == 2:
        return ternary_quantize(w, num_groups)
    return binary_quantize(w, num_groups)


class _TopK(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, scores: torch.Tensor, ratio: float) -> torch.Tensor:
        mask = torch.zeros_like(scores)
        order = scores.flatten().argsort(descending=True, stable=True)
        mask.view(-1)[order[: math.ceil(ratio * scores.numel())]] = 1.0
        return mask

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return grad.clone(), None


def topk_mask(scores: torch.Tensor, ratio: float) -> torch.Tensor:
    """A 0/1 mask keeping the ``ceil(ratio * numel)`` largest scores; the gradient reaches the
    scores unchanged (straight-through), so learned scores (``method: topk``) train."""
    return _TopK.apply(scores, ratio)  # type: ignore[no-any-return]
