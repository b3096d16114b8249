"""The low-precision matrix products behind :class:`~slipstream.quant.QuantLinear`.

* :func:`int8_gemm` — INT8 x INT8 -> INT32, a real integer product:

  - ``"int_mm"``: ``torch._int_mm`` (CPU and CUDA). Exact int32 accumulation. CUDA requires
    M > 16 and K, N multiples of 8, so operands are zero-padded there (zeros add nothing to
    the sums). torch 2.13 on CPU accepts any shape (checked by a test), so no padding.
  - ``"fbgemm"``: the x86 FBGEMM int8 kernel (``quantized::linear_with_input_q_dq_qweight_
    dq_output_fp32``, u8 activations with zero point 128 x s8 weights). On CPUs without VNNI
    it multiplies through ``vpmaddubsw``, which *saturates* the int16 sum of two adjacent
    products; with weights limited to [-63, 63] that sum is at most 255 * 63 * 2 = 32130
    < 32767, so the int32 result is exact again. The caller quantizes weights to 7 bits for
    this backend. Returns the int32 sums as fp32 (exact below 2**24).

* :func:`fp8_gemm` — FP8 x FP8 with fp32 accumulation and row/column scales, through
  ``torch._scaled_mm`` where the backend supports the call, else the exact-operand fallback
  ``a.float() @ b.float().T`` (every FP8 product is exact in fp32; only the sum rounds).
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Literal

import torch
import torch.nn.functional as F

__all__ = ["FbgemmPacked", "Int8Backend", "fp8_gemm", "int8_gemm", "scaled_mm_works"]

logger = logging.getLogger(__name__)

Int8Backend = Literal["int_mm", "fbgemm"]

FBGEMM_WEIGHT_QMAX = 63
"""Largest int8 weight magnitude for which FBGEMM's AVX2 int16 pair sums cannot saturate."""


def _pad_to(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return F.pad(t, (0, cols - t.shape[1], 0, rows - t.shape[0]))


def int_mm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``a [M, K] int8 @ w[N, K].T int8 -> int32 [M, N]`` via ``torch._int_mm``, padded on CUDA."""
    m, k = a.shape
    n = w.shape[0]
    if a.device.type == "cuda":
        mp, kp, np_ = max(m, 17), -(-k // 8) * 8, -(-n // 8) * 8
        if (mp, kp, np_) != (m, k, n):
            out = torch._int_mm(_pad_to(a, mp, kp), _pad_to(w, np_, kp).t())
            return out[:m, :n]
    return torch._int_mm(a, w.t())


class FbgemmPacked:
    """A weight prepacked for the FBGEMM int8 kernel (not part of any state dict)."""

    def __init__(self, w_q: torch.Tensor, row_scale: torch.Tensor | None = None) -> None:
        """``w_q [N, K]`` int8 in [-63, 63]; ``row_scale [N]`` (optional) is applied by the
        kernel's fp32 output stage (``out[:, n] = sum * row_scale[n]``), else 1."""
        if w_q.abs().max() > FBGEMM_WEIGHT_QMAX:
            raise ValueError(
                f"fbgemm int8 backend needs weights in [-{FBGEMM_WEIGHT_QMAX}, "
                f"{FBGEMM_WEIGHT_QMAX}] to avoid int16 saturation; quantize with qmax=63"
            )
        if torch.backends.quantized.engine not in ("x86", "fbgemm"):
            raise RuntimeError(
                f"fbgemm int8 backend needs torch.backends.quantized.engine 'x86' or 'fbgemm', "
                f"got {torch.backends.quantized.engine!r}; use backend='int_mm'"
            )
        n = w_q.shape[0]
        with warnings.catch_warnings():  # quantized-tensor deprecation notice, not actionable
            warnings.simplefilter("ignore", UserWarning)
            qw = torch._make_per_channel_quantized_tensor(
                w_q.cpu(),
                torch.ones(n, dtype=torch.double)
                if row_scale is None
                else row_scale.detach().reshape(n).cpu().double(),
                torch.zeros(n, dtype=torch.long),
                0,
            )
            self.packed: Any = torch.ops.quantized.linear_prepack(qw, None)

    def __call__(self, a: torch.Tensor) -> torch.Tensor:
        """int-valued fp32 or int8 ``a [M, K]`` -> fp32 integer sums ``[M, N]`` (times the
        row scale if one was given)."""
        op = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32
        return op(a.float(), 1.0, 128, self.packed)


def int8_gemm(
    a: torch.Tensor, w: torch.Tensor, backend: Int8Backend, packed: FbgemmPacked | None = None
) -> torch.Tensor:
    """Integer product ``a @ w.T`` returned as fp32 (exact int32 sums). See module doc."""
    if backend == "fbgemm" and a.device.type == "cpu":
        if packed is None:
            packed = FbgemmPacked(w)
        return packed(a)
    return int_mm(a, w).float()


_SCALED_MM_OK: dict[str, bool] = {}
# Output dtype torch._scaled_mm accepts with row-wise scales, per device type: some CUDA
# builds allow only bf16 output for row-wise scaling (then the result is cast to fp32).
_SCALED_MM_OUT: dict[str, torch.dtype] = {}


def scaled_mm_works(device_type: str) -> bool:
    """Whether :func:`fp8_gemm` has used ``torch._scaled_mm`` on ``device_type`` (False before
    the first call there, or after it fell back)."""
    return _SCALED_MM_OK.get(device_type, False)


def _pad_cols(t: torch.Tensor, extra: int) -> torch.Tensor:
    # Zero columns on the reduction dim add nothing; cat keeps the fp8 dtype (pad may not).
    return torch.cat((t, torch.zeros(t.shape[0], extra, dtype=t.dtype, device=t.device)), dim=1)


def _pad_rows(t: torch.Tensor, extra: int) -> torch.Tensor:
    return torch.cat((t, torch.zeros(extra, t.shape[1], dtype=t.dtype, device=t.device)), dim=0)


def _scaled_mm(
    a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor
) -> torch.Tensor:
    dev = a.device.type
    k, n = a.shape[1], b.shape[0]
    if dev == "cuda" and k % 16:  # K and N must be multiples of 16 on CUDA
        a, b = _pad_cols(a, 16 - k % 16), _pad_cols(b, 16 - k % 16)
    if dev == "cuda" and n % 16:
        b, sb = _pad_rows(b, 16 - n % 16), F.pad(sb, (0, 16 - n % 16), value=1.0)
    outs = [_SCALED_MM_OUT[dev]] if dev in _SCALED_MM_OUT else [torch.float32, torch.bfloat16]
    for i, out_dtype in enumerate(outs):
        try:
            out = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype)
        except (RuntimeError, NotImplementedError):
            if i == len(outs) - 1:
                raise
            continue
        _SCALED_MM_OUT[dev] = out_dtype
        return out[:, :n].float()
    raise AssertionError("unreachable")


def fp8_gemm(
    a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor
) -> torch.Tensor:
    """``(a [M, K] fp8 * scale_a [M, 1]) @ (b [N, K] fp8 * scale_b [N, 1]).T`` in fp32.

    Uses ``torch._scaled_mm`` (row-wise scales; fp32 output, or bf16 output cast to fp32
    where the backend allows only that) when the device's backend accepts it; the first
    failure on a device type is logged once and the exact-operand fallback is used.
    Returns a new tensor.
    """
    dev = a.device.type
    sa, sb = scale_a.float().reshape(-1, 1), scale_b.float().reshape(1, -1)
    if _SCALED_MM_OK.get(dev, True):
        try:
            out = _scaled_mm(a, b, sa, sb)
            _SCALED_MM_OK[dev] = True
            return out
        except (RuntimeError, NotImplementedError) as exc:
            _SCALED_MM_OK[dev] = False
            logger.info(
                "torch._scaled_mm unavailable on %s (%s); using the fp32 fallback", dev, exc
            )
    return (a.float() @ b.float().t()) * sa * sb
