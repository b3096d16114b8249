"""Weight quantizers: INT8/FP8 per channel, INT4/FP4 per group with power-of-two scale ratios.

4-bit weights use fine-grained group scales along the input dimension (ZeroQuant-FP sec. 3,
spec sec. 2.2). The GEMM needs both operands in the 8-bit activation format, and a group
scale sits on the reduction dimension, so it cannot be applied after the GEMM (rule R2). The
two scaling constraints make the 4-bit -> 8-bit conversion *exact*, a pure exponent shift:

* ``"row_pow2"`` (M2): per row a real scale ``c_r = max_g s_g``; each group scale is rounded up
  to ``c_r * 2**e_g`` with an integer ``e_g`` in ``[e_min, 0]``.
* ``"pow2"`` (M1): each group scale is rounded up to a power of two; the row scale is the
  largest of them (also a power of two) and ``e_g = log2(s_g / c_r)``.

Rounding the scale *up* means no group value clips. Then

* FP4: ``w8 = fp4 * 2**e_g`` is exactly representable in E4M3 for ``e_g`` in [-8, 0]
  (spec: "every E2M1 value x 2^k is exact in E4M3 for k in [-8, 6]").
* INT4: ``w8 = q4 * 2**(4 + e_g)`` is an exact int8 (|q4| <= 7, so |w8| <= 112) for ``e_g`` in
  [-4, 0], with row scale ``c_r / 16``.

The spec marks these exact definitions as a reconstruction (UNCONFIRMED against the paper).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from slipstream.quant._formats import (
    E2M1,
    E4M3,
    fp4_decode,
    fp4_encode,
    fp4_pack,
    fp4_unpack,
    fp_round,
    quantize_per_channel,
)

__all__ = [
    "GroupWeight",
    "ScaleConstraint",
    "constrain_group_scales",
    "dequantize_group_weight",
    "expand_group_weight",
    "quantize_fp8_per_channel",
    "quantize_group_weight",
    "quantize_int8_per_channel",
]

ScaleConstraint = Literal["pow2", "row_pow2"]

_INT4_QMAX = 7
_FP4_EMIN = -8  # E2M1 * 2**-8 bottoms out at E4M3's smallest subnormal 2**-9


@dataclass
class GroupWeight:
    """A 4-bit weight ``[d_out, d_in]`` with per-group power-of-two scale ratios."""

    packed: torch.Tensor
    """uint8 ``[d_out, d_in // 2]``: two 4-bit codes per byte (low nibble first). INT4 codes
    are two's complement nibbles; FP4 codes are E2M1 bit patterns."""
    group_exp: torch.Tensor
    """int8 ``[d_out, d_in // group_size]``: the exponent e_g of each group's scale ratio."""
    row_scale: torch.Tensor
    """fp32 ``[d_out, 1]``: c_r; the weight is ``value * 2**e_g * c_r``."""
    fmt: Literal["int4", "e2m1"]
    """Code format of ``packed``."""
    group_size: int
    """Input features per group."""
    int_shift: int = 4
    """INT4 only: the int8 operand is ``q4 * 2**(int_shift + e_g)`` (4: |w8| <= 112 for
    ``torch._int_mm``; 3: |w8| <= 56 for the 7-bit FBGEMM path)."""


def quantize_fp8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 weights with a per-output-channel scale ``absmax / 448``.

    Returns ``(w_fp8 float8_e4m3fn [d_out, d_in], scale fp32 [d_out, 1])``.
    """
    absmax = w.detach().float().abs().amax(dim=1, keepdim=True)
    scale = torch.where(absmax > 0, absmax / E4M3.max_value, torch.ones_like(absmax))
    return fp_round(w / scale, E4M3).to(torch.float8_e4m3fn), scale


def constrain_group_scales(
    scales: torch.Tensor, constraint: ScaleConstraint, e_min: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Round group scales ``[d_out, n_groups]`` up to ``row_scale * 2**e`` (see module doc).

    Returns ``(row_scale fp32 [d_out, 1], exp int8 [d_out, n_groups])`` with e in [e_min, 0]
    and ``row_scale * 2**e >= scales`` elementwise (so quantizing with them never clips).
    """
    s = scales.float()
    if constraint == "pow2":
        s = torch.exp2(torch.ceil(torch.log2(s.clamp(min=torch.finfo(torch.float32).tiny))))
    elif constraint != "row_pow2":
        raise ValueError(f"unknown scale constraint {constraint!r}; use 'pow2' or 'row_pow2'")
    row = s.amax(dim=1, keepdim=True)
    row = torch.where(row > 0, row, torch.ones_like(row))
    ratio = (s / row).clamp(min=2.0**e_min)
    e = torch.ceil(torch.log2(ratio))
    # log2 of a non-power-of-two may land a hair low; bump any exponent that would clip.
    e = torch.where(row * torch.exp2(e) < s, e + 1, e).clamp(e_min, 0)
    return row, e.to(torch.int8)


def quantize_group_weight(
    w: torch.Tensor,
    fmt: Literal["int4", "e2m1"],
    group_size: int,
    constraint: ScaleConstraint = "row_pow2",
    int_shift: int = 4,
) -> GroupWeight:
    """Quantize ``w [d_out, d_in]`` to packed 4-bit codes with constrained group scales.

    Raises:
        ValueError: ``d_in`` is not a multiple of ``group_size`` or is odd.
    """
    d_out, d_in = w.shape
    if d_in % group_size or group_size % 2:
        raise ValueError(
            f"weight [{d_out}, {d_in}]: in_features={d_in} is not a multiple of the even "
            f"group_size={group_size}; pick a group_size dividing {d_in} or skip this module"
        )
    qmax, e_min = (_INT4_QMAX, -int_shift) if fmt == "int4" else (E2M1.max_value, _FP4_EMIN)
    wg = w.detach().float().reshape(d_out, d_in // group_size, group_size)
    raw = wg.abs().amax(dim=-1) / qmax
    row, e = constrain_group_scales(raw, constraint, e_min)
    scale = (row * torch.exp2(e.float())).unsqueeze(-1)  # [d_out, n_groups, 1]
    if fmt == "int4":
        q = torch.round(wg / scale).clamp(-_INT4_QMAX, _INT4_QMAX).to(torch.int8)
        codes = (q.reshape(d_out, d_in) & 0x0F).to(torch.uint8)
    else:
        codes = fp4_encode(fp_round(wg / scale, E2M1)).reshape(d_out, d_in)
    return GroupWeight(fp4_pack(codes), e, row, fmt, group_size, int_shift)


def _codes_to_values(gw: GroupWeight) -> torch.Tensor:
    codes = fp4_unpack(gw.packed)
    if gw.fmt == "int4":
        return ((codes.to(torch.int16) ^ 0x8) - 0x8).float()  # sign-extend the nibble
    return fp4_decode(codes)


def expand_group_weight(gw: GroupWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8-bit GEMM operand of a 4-bit weight, by exact exponent shifts.

    Returns ``(w8, row_scale)`` with ``w ~= w8 * row_scale``: for INT4 ``w8`` is int8
    ``q4 * 2**(4 + e_g)`` and row_scale is ``c_r / 16``; for FP4 ``w8`` is float8_e4m3fn
    ``fp4 * 2**e_g`` and row_scale is ``c_r``. Both conversions are exact.
    """
    vals = _codes_to_values(gw)
    shift = gw.group_exp.float().repeat_interleave(gw.group_size, dim=1)
    if gw.fmt == "int4":
        w8 = (vals * torch.exp2(shift + gw.int_shift)).to(torch.int8)
        return w8, gw.row_scale / 2**gw.int_shift
    return (vals * torch.exp2(shift)).to(torch.float8_e4m3fn), gw.row_scale


def dequantize_group_weight(gw: GroupWeight) -> torch.Tensor:
    """fp32 ``[d_out, d_in]`` reconstruction of a 4-bit weight."""
    w8, row = expand_group_weight(gw)
    return w8.float() * row


def quantize_int8_per_channel(
    w: torch.Tensor, qmax: int = 127
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel symmetric int weights in ``[-qmax, qmax]`` (qmax 63 for the fbgemm path)."""
    if qmax == 127:
        return quantize_per_channel(w)
    absmax = w.detach().float().abs().amax(dim=1, keepdim=True)
    scale = torch.where(absmax > 0, absmax / qmax, torch.ones_like(absmax))
    return torch.round(w.float() / scale).clamp(-qmax, qmax).to(torch.int8), scale
