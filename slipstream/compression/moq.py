"""MoQ: DeepSpeed's Mixture-of-Quantization, the ``quantize_weight_in_forward: false`` mode of
``weight_quantization`` (DeepSpeed 0.19.6 ``runtime/quantize.py``; removed in 0.19.8).

With fp16 training, after every applied optimizer step (and on each forward before the
first step) the fp16 weights of the groups' modules are overwritten by their quantized
values, while the fp32 master weights stay exact. Each weight starts at ``start_bits`` and
loses one bit whenever the quantizer's step count reaches its ``quantization_period``, which
then doubles, until ``target_bits``. Ranges are per ``quantize_groups`` group; ``rounding``
``stochastic`` adds uniform noise in [-0.5, 0.5) before rounding; ``fp16_mixed_quantize``
blends the float and quantized weights, the float share falling by
``quantize_change_ratio`` per step, within a bit of the target.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from slipstream._logging import log_rank0
from slipstream.compression.quantizers import binary_quantize, ternary_quantize
from slipstream.config.compression import WeightQuantizationShared

__all__ = ["MoQ"]


def _weight(module: nn.Module) -> torch.Tensor:
    w: torch.Tensor = module.weight  # type: ignore[assignment]
    return w


class _Weight:
    def __init__(self, module: Any) -> None:
        self.module = module
        self.bits: int = module.moq_start_bits
        self.target: int = module.weight_bits
        self.period: int = module.moq_period


class MoQ:
    """The quantizer the engine calls after each applied step (``quantize``)."""

    def __init__(self, model: nn.Module, shared: WeightQuantizationShared) -> None:
        self.groups = shared.quantize_groups
        self.kind = shared.quantization_type
        self.stochastic = shared.rounding == "stochastic"
        self.mixed = shared.fp16_mixed_quantize.enabled
        self.change_ratio = shared.fp16_mixed_quantize.quantize_change_ratio
        self.verbose = shared.quantize_verbose
        self.qsteps = 0
        self.real_ratio = 1.0
        self.weights = [
            _Weight(m)
            for m in model.modules()
            if getattr(m, "weight_bits", None) is not None
            and not m.weight_quantization_enabled_in_forward
            and _weight(m).dim() > 1
        ]

    def quantize(self) -> None:
        """One MoQ step: count it, move the fp16 blend, requantize every weight in place."""
        self.qsteps += 1
        if self.mixed:
            self.real_ratio = self.real_ratio - self.change_ratio if self.real_ratio > 0 else 0.0
        with torch.no_grad():
            for w in self.weights:
                # In place: the optimizer writes the next step's values into this storage.
                w.module.weight.data.copy_(self._quantized(w))

    def _quantized(self, w: _Weight) -> torch.Tensor:
        if w.bits != w.target and self.qsteps >= w.period:
            self.real_ratio = 1.0
            w.period <<= 1
            w.bits -= 1
            if self.verbose:
                log_rank0(f"MoQ: {w.bits} bits at step {self.qsteps}, period {w.period}")
        x = w.module.weight.data
        if w.bits >= 3:
            out = self._uniform(x, w.bits)
        elif w.bits == 2:
            out = ternary_quantize(x, self.groups)
        else:
            out = binary_quantize(x, self.groups)
        if self.mixed and w.bits >= w.target - 1:
            out = self.real_ratio * x + (1 - self.real_ratio) * out
        return out

    def _uniform(self, x: torch.Tensor, bits: int) -> torch.Tensor:
        levels = 2**bits
        flat = x.reshape(self.groups, -1)
        lo = flat.amin(dim=-1, keepdim=True)
        hi = flat.amax(dim=-1, keepdim=True)
        noise: Any = flat.new(flat.shape).uniform_(-0.5, 0.5) if self.stochastic else 0.0
        if self.kind == "symmetric":
            scale = 2 * torch.max(torch.abs(lo), torch.abs(hi)) / levels
            q = (flat / scale + noise).round().clamp(-(levels >> 1), (levels >> 1) - 1) * scale
        else:
            scale = (hi - lo) / levels
            zero = (lo / scale).round() * scale
            q = ((flat - zero) / scale + noise).round().clamp(0, levels - 1) * scale + zero
        return q.reshape(x.shape).contiguous()
