"""Number formats: symmetric INT8/INT4 and the FP8 (E4M3, E5M2) / FP4 (E2M1) minifloats.

Every quantizer here is *saturating* and rounds to nearest, ties to even (RNE), as ZeroQuant-FP
prescribes (arXiv 2307.09782, sec. 2; spec sec. 2.2 "Formats"): a value beyond the largest
finite magnitude clamps to it and never becomes NaN/inf. Minifloat rounding is done in fp32
arithmetic on a power-of-two grid, so it is exact (every step is a power of two and every
grid point is an fp32 number); tests check it against ``torch.float8_*`` casts and against the
E2M1 table for every representable value, every tie and the clamping.

Scale granularity (ZeroQuant-HERO sec. 1.2, spec "Quantization primitives"):

* per-token: one scale per row of an activation ``[..., n_tokens, d]`` (dynamic),
* per-channel: one scale per output row of a weight ``[d_out, d_in]``,
* per-tensor: one scalar,
* per-group: one scale per ``group_size`` consecutive input features of a weight row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "E2M1",
    "E4M3",
    "E5M2",
    "FP_FORMATS",
    "FPFormat",
    "dequantize_int",
    "fp4_decode",
    "fp4_encode",
    "fp4_pack",
    "fp4_unpack",
    "fp_round",
    "int_absmax_scale",
    "int_codes",
    "per_token_codes",
    "quantize_int",
    "quantize_per_channel",
    "quantize_per_tensor",
    "quantize_per_token",
]


@dataclass(frozen=True)
class FPFormat:
    """A sign + exponent + mantissa minifloat without inf/NaN encodings used by us."""

    name: str
    """Short name, e.g. ``"e4m3"``."""
    exp_bits: int
    """Exponent field width."""
    man_bits: int
    """Mantissa (fraction) field width."""
    bias: int
    """Exponent bias."""
    max_value: float
    """Largest finite magnitude (the saturation point)."""

    @property
    def min_normal_exp(self) -> int:
        """Unbiased exponent of the smallest normal number (``1 - bias``)."""
        return 1 - self.bias

    @property
    def min_subnormal(self) -> float:
        """Smallest positive magnitude, ``2 ** (1 - bias - man_bits)``."""
        return 2.0 ** (self.min_normal_exp - self.man_bits)

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """The matching ``torch.float8_*`` dtype, or None (FP4 has no unpacked torch dtype)."""
        return {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}.get(self.name)


E4M3 = FPFormat("e4m3", exp_bits=4, man_bits=3, bias=7, max_value=448.0)
"""OCP FP8 E4M3 ("fn": no inf, max 448)."""
E5M2 = FPFormat("e5m2", exp_bits=5, man_bits=2, bias=15, max_value=57344.0)
"""OCP FP8 E5M2 (max finite 57344; we saturate instead of producing inf)."""
E2M1 = FPFormat("e2m1", exp_bits=2, man_bits=1, bias=1, max_value=6.0)
"""OCP FP4 E2M1: magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}."""
FP_FORMATS: dict[str, FPFormat] = {f.name: f for f in (E4M3, E5M2, E2M1)}

# E2M1 magnitudes in code order: the 3 magnitude bits (EEM) index this table.
_E2M1_TABLE = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def fp_round(x: torch.Tensor, fmt: FPFormat) -> torch.Tensor:
    """Round ``x`` to the nearest value of ``fmt`` (ties to even), saturating at ±max.

    Returns an fp32 tensor whose values are all representable in ``fmt``. NaN inputs stay
    NaN; ±inf saturate to ±max. Cost: a few elementwise fp32 passes.
    """
    x = x.float().clamp(-fmt.max_value, fmt.max_value)
    mag = x.abs()
    # Exponent of the binade holding |x|; below the normal range the grid step is fixed
    # (subnormals), so clamp the exponent from below.
    _, exp = torch.frexp(mag)  # mag = m * 2**exp, m in [0.5, 1)
    exp = (exp - 1).clamp(min=fmt.min_normal_exp)
    step = torch.ldexp(torch.ones_like(mag), exp - fmt.man_bits)
    # x / step is exact (power-of-two divide); torch.round is round-half-to-even.
    out = torch.round(x / step) * step
    # Rounding up in the top binade can exceed max (e.g. 464 -> 480 for E4M3): saturate.
    return out.clamp(-fmt.max_value, fmt.max_value)


def fp4_encode(x: torch.Tensor) -> torch.Tensor:
    """Encode values already on the E2M1 grid (see :func:`fp_round`) as 4-bit codes.

    Returns uint8 codes in [0, 15]: bit 3 is the sign, bits 0-2 index the magnitude table
    (which is the E2M1 bit layout ``s ee m``). Raises ValueError if a value is off-grid.
    """
    table = torch.tensor(_E2M1_TABLE, device=x.device)
    mag = x.abs().float()
    idx = torch.searchsorted(table, mag)
    idx = idx.clamp(max=len(_E2M1_TABLE) - 1)
    if not torch.equal(table[idx], mag):
        raise ValueError(
            "fp4_encode got values that are not E2M1 grid points; round them first with "
            "fp_round(x, E2M1)"
        )
    sign = (x < 0).to(torch.uint8) << 3
    return idx.to(torch.uint8) | sign


def fp4_decode(codes: torch.Tensor) -> torch.Tensor:
    """Decode 4-bit E2M1 codes (uint8 in [0, 15]) to fp32 values."""
    table = torch.tensor(_E2M1_TABLE, device=codes.device)
    mag = table[(codes & 0x7).long()]
    return torch.where((codes & 0x8) != 0, -mag, mag)


def fp4_pack(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes two per byte along the last dim (low nibble first).

    Args:
        codes: uint8 ``[..., n]`` with n even.
    Returns:
        uint8 ``[..., n // 2]``.
    """
    if codes.shape[-1] % 2:
        raise ValueError(
            f"fp4_pack needs an even last dimension, got {tuple(codes.shape)}; pad to even"
        )
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def fp4_unpack(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`fp4_pack`: uint8 ``[..., n // 2]`` -> codes ``[..., n]``."""
    lo, hi = packed & 0x0F, packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def int_absmax_scale(absmax: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """Symmetric scale ``absmax / qmax`` (qmax = 2**(bits-1) - 1), with 0 mapped to 1.

    A zero row (all-zero token or weight row) gets scale 1 so dividing by it is safe and it
    quantizes to zeros.
    """
    qmax = 2 ** (bits - 1) - 1
    absmax = absmax.float()
    return torch.where(absmax > 0, absmax / qmax, torch.ones_like(absmax))


def quantize_int(x: torch.Tensor, scale: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """``clamp(round(x / scale), -qmax, qmax)`` as int8 (RNE rounding, symmetric range).

    ``scale`` must broadcast against ``x``. For ``bits`` < 8 the values still live in int8.
    """
    return int_codes(x, scale, bits).to(torch.int8)


def int_codes(x: torch.Tensor, scale: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """The codes of :func:`quantize_int` as integer-valued fp32 (same values, no int8 cast).

    For GEMM kernels that take float inputs (FBGEMM): saves the int8 round trip. One new
    tensor; rounding and clamping run in place on it.
    """
    qmax = 2 ** (bits - 1) - 1
    return torch.div(x.float(), scale).round_().clamp_(-qmax, qmax)


def dequantize_int(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q * scale`` in fp32."""
    return q.float() * scale


def quantize_per_token(x: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token (per-row of the last dim) symmetric quantization.

    Returns ``(q int8 [..., d], scale fp32 [..., 1])``. Error bound: ``|x - q*s| <= s/2``.
    """
    scale = int_absmax_scale(x.detach().abs().amax(dim=-1, keepdim=True), bits)
    return quantize_int(x, scale, bits), scale


def per_token_codes(x: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_per_token` with the codes as integer-valued fp32 (see :func:`int_codes`);
    the values equal the int8 codes exactly."""
    scale = int_absmax_scale(x.detach().abs().amax(dim=-1, keepdim=True), bits)
    return int_codes(x, scale, bits), scale


def quantize_per_channel(w: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel quantization of a weight ``[d_out, d_in]``.

    Returns ``(q int8 [d_out, d_in], scale fp32 [d_out, 1])``.
    """
    if w.dim() != 2:
        raise ValueError(f"quantize_per_channel expects a 2-D weight, got {tuple(w.shape)}")
    return quantize_per_token(w, bits)


def quantize_per_tensor(
    x: torch.Tensor, bits: int = 8, absmax: torch.Tensor | float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor quantization with one scale (from ``absmax``, e.g. calibrated, or from x).

    Values beyond a calibrated ``absmax`` clamp. Returns ``(q int8, scale fp32 scalar)``.
    """
    amax = x.detach().abs().amax() if absmax is None else torch.as_tensor(absmax)
    scale = int_absmax_scale(amax.to(x.device), bits)
    return quantize_int(x, scale, bits), scale
