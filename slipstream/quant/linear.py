"""``QuantLinear``: an ``nn.Linear`` replacement running a real low-precision GEMM.

What runs in which format (per forward, input ``x [..., K]`` in any float dtype):

=============  ==============================  ===============================  ================
scheme         weight (stored)                 GEMM operands                     accumulate
=============  ==============================  ===============================  ================
W8A8 INT       int8 per channel                int8 x int8 (per-token / static)  int32
W4A8 INT4      packed int4, pow2 group ratios  int8 (exact shift) x int8         int32
W8A8 FP8       E4M3 per channel                FP8 (E4M3/E5M2) x E4M3            fp32
W4A8 FP4       packed E2M1, pow2 group ratios  FP8 x E4M3 (exact shift)          fp32
=============  ==============================  ===============================  ================

The epilogue (fp32) multiplies by ``s_x[token] * s_w[channel]`` (rule R1), adds the bias and
the optional LoRC term ``(x @ A) @ B`` (fp32, from the unquantized ``x``), and casts back to
``x.dtype``. INT8 activations may come pre-quantized from a fused norm (see ``hero.py``).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from slipstream.quant._formats import (
    FP_FORMATS,
    fp_round,
    int_codes,
    per_token_codes,
    quantize_int,
    quantize_per_token,
)
from slipstream.quant._gemm import FBGEMM_WEIGHT_QMAX, FbgemmPacked, fp8_gemm, int_mm
from slipstream.quant._weights import (
    GroupWeight,
    dequantize_group_weight,
    expand_group_weight,
    quantize_fp8_per_channel,
    quantize_group_weight,
    quantize_int8_per_channel,
)
from slipstream.quant.lorc import lorc_factors

__all__ = ["INT8_HANDOFF_ATTR", "QuantLinear"]

WeightFormat = Literal["int8", "e4m3", "int4", "e2m1"]
ActFormat = Literal["int8", "e4m3", "e5m2"]

INT8_HANDOFF_ATTR = "_slipstream_int8_rows"
"""Attribute a fused norm sets on its output tensor: ``(q int8 [..., K], scale [..., 1])``."""

_FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


class QuantLinear(nn.Module):
    """Quantized linear layer; build it with :meth:`from_float`.

    Buffers (all saved in ``state_dict``): ``qweight``, ``weight_scale`` [N, 1], optional
    ``group_exp`` (4-bit), ``bias``, ``lorc_a`` [K, r] / ``lorc_b`` [r, N], ``act_absmax``
    (static activation range, set by calibration).
    """

    qweight: torch.Tensor
    weight_scale: torch.Tensor
    group_exp: torch.Tensor
    bias: torch.Tensor | None
    lorc_a: torch.Tensor
    lorc_b: torch.Tensor
    act_absmax: torch.Tensor

    def __init__(
        self,
        in_features: int,
        out_features: int,
        weight_format: WeightFormat,
        act_format: ActFormat,
        *,
        act_static: bool = False,
        backend: Literal["int_mm", "fbgemm"] = "int_mm",
        group_size: int = 0,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight_format: WeightFormat = weight_format
        self.act_format: ActFormat = act_format
        self.act_static = act_static
        self.backend = backend
        self.group_size = group_size
        self.int_shift = 3 if backend == "fbgemm" else 4
        self.observing = False
        self._packed: FbgemmPacked | None = None
        self.register_buffer("act_absmax", torch.zeros(()))

    @classmethod
    def from_float(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        weight_format: WeightFormat,
        act_format: ActFormat,
        *,
        act_static: bool = False,
        backend: Literal["int_mm", "fbgemm"] = "int_mm",
        group_size: int = 64,
        constraint: Literal["pow2", "row_pow2"] = "row_pow2",
        lorc_rank: int = 0,
    ) -> QuantLinear:
        """Quantize a float ``weight [N, K]`` (and keep ``bias`` in fp32)."""
        n, k = weight.shape
        four_bit = weight_format in ("int4", "e2m1")
        mod = cls(
            k,
            n,
            weight_format,
            act_format,
            act_static=act_static,
            backend=backend,
            group_size=group_size if four_bit else 0,
        )
        w = weight.detach().float()
        if weight_format == "int8":
            qmax = FBGEMM_WEIGHT_QMAX if backend == "fbgemm" else 127
            qw, scale = quantize_int8_per_channel(w, qmax)
            mod.register_buffer("qweight", qw)
        elif weight_format == "e4m3":
            qw, scale = quantize_fp8_per_channel(w)
            mod.register_buffer("qweight", qw)
        else:
            gw = quantize_group_weight(w, weight_format, group_size, constraint, mod.int_shift)
            mod.register_buffer("qweight", gw.packed)
            mod.register_buffer("group_exp", gw.group_exp)
            scale = gw.row_scale
        mod.register_buffer("weight_scale", scale)
        mod.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        if lorc_rank:
            a, b = lorc_factors(w - mod.dequantized_weight(), lorc_rank)
            mod.register_buffer("lorc_a", a)
            mod.register_buffer("lorc_b", b)
        return mod.to(weight.device)

    # -- weights ---------------------------------------------------------------------------
    def _group_weight(self) -> GroupWeight:
        fmt: Literal["int4", "e2m1"] = "int4" if self.weight_format == "int4" else "e2m1"
        return GroupWeight(
            self.qweight, self.group_exp, self.weight_scale, fmt, self.group_size, self.int_shift
        )

    def gemm_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The 8-bit GEMM operand ``[N, K]`` (int8 or float8_e4m3fn) and its row scale."""
        if self.weight_format in ("int8", "e4m3"):
            return self.qweight, self.weight_scale
        return expand_group_weight(self._group_weight())

    def dequantized_weight(self) -> torch.Tensor:
        """fp32 ``[N, K]`` weight the GEMM effectively uses (without LoRC)."""
        if self.weight_format in ("int4", "e2m1"):
            return dequantize_group_weight(self._group_weight())
        return self.qweight.float() * self.weight_scale

    def _fbgemm(self) -> FbgemmPacked | None:
        """The prepacked FBGEMM weight (CPU, ``backend="fbgemm"``, INT8 activations), else None."""
        if self.backend != "fbgemm" or self.act_format != "int8":
            return None
        if self.qweight.device.type != "cpu":
            return None
        if self._packed is None:
            # Packed once, with the weight's row scale applied by the kernel's fp32 output
            # stage (for INT4 this holds the expanded int8 weight: speed over memory).
            w8, w_scale = self.gemm_weight()
            self._packed = FbgemmPacked(w8, w_scale)
        return self._packed

    def _load_from_state_dict(self, *args: object, **kwargs: object) -> None:
        self._packed = None  # weights may change: repack lazily
        super()._load_from_state_dict(*args, **kwargs)  # type: ignore[arg-type]

    # -- activations -----------------------------------------------------------------------
    def _quantize_int8_act(
        self, x: torch.Tensor, x2: torch.Tensor, float_codes: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Int8 codes ``[M, K]`` (int8, or the same values as fp32 if ``float_codes``) and the
        per-row scale ``[M, 1]``: static, handed off by a fused norm, or dynamic per token."""
        if self.act_static:
            if not self.act_absmax > 0:
                raise RuntimeError(
                    f"QuantLinear({self.in_features}->{self.out_features}) uses static "
                    "activation scales but was never calibrated; run "
                    "slipstream.quant.calibrate(model, batches) first"
                )
            scale = (self.act_absmax / 127).reshape(1, 1)
            q = int_codes(x2, scale) if float_codes else quantize_int(x2, scale)
            return q, scale.expand(x2.shape[0], 1)
        handoff = getattr(x, INT8_HANDOFF_ATTR, None)
        if handoff is not None:
            q, s = handoff
            q = q.reshape(-1, self.in_features)
            return (q.float() if float_codes else q), s.reshape(-1, 1)
        return per_token_codes(x2) if float_codes else quantize_per_token(x2)

    def _quantize_fp8_act(self, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        fmt = FP_FORMATS[self.act_format]
        if self.act_static:
            scale = (self.act_absmax / fmt.max_value).reshape(1, 1).expand(x2.shape[0], 1)
        else:
            absmax = x2.abs().amax(dim=-1, keepdim=True)
            scale = torch.where(absmax > 0, absmax / fmt.max_value, torch.ones_like(absmax))
        return fp_round(x2 / scale, fmt).to(_FP8_DTYPES[self.act_format]), scale

    # -- forward ---------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., K] -> [..., N]`` in ``x.dtype`` through the low-precision GEMM."""
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"QuantLinear expects in_features={self.in_features}, got input "
                f"{tuple(x.shape)}; check the module this layer replaced"
            )
        x2 = x.reshape(-1, self.in_features).float()
        if self.observing:
            self.act_absmax = torch.maximum(self.act_absmax, x2.detach().abs().amax())
        # Every branch yields a fresh fp32 y, so the epilogue runs in place.
        packed = self._fbgemm()
        if packed is not None:
            # FBGEMM takes integer-valued fp32 codes and applies s_w itself: only s_x is left.
            xq, x_scale = self._quantize_int8_act(x, x2, float_codes=True)
            y = packed(xq).mul_(x_scale)
        elif self.act_format == "int8":
            w8, w_scale = self.gemm_weight()
            xq, x_scale = self._quantize_int8_act(x, x2)
            # int32 * fp32 promotes inside the multiply: no separate int32 -> fp32 pass.
            y = torch.mul(int_mm(xq, w8), x_scale).mul_(w_scale.reshape(1, -1))
        else:
            w8, w_scale = self.gemm_weight()
            xq, x_scale = self._quantize_fp8_act(x2)
            y = fp8_gemm(xq, w8, x_scale, w_scale)
        if self.bias is not None:
            y.add_(self.bias)
        if hasattr(self, "lorc_a"):
            y.addmm_(x2 @ self.lorc_a, self.lorc_b)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        s = (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"weight={self.weight_format}, act={self.act_format}"
            f"{'(static)' if self.act_static else '(per-token)'}"
        )
        if self.group_size:
            s += f", group_size={self.group_size}"
        if hasattr(self, "lorc_a"):
            s += f", lorc_rank={self.lorc_a.shape[1]}"
        return s + (f", backend={self.backend}" if self.act_format == "int8" else "")

    def weight_bytes(self) -> int:
        """Bytes of every stored tensor (weights, scales, exponents, LoRC factors, bias)."""
        return sum(b.numel() * b.element_size() for b in self.buffers())
