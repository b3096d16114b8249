"""Typed ``fp16``, ``bf16`` and ``data_types`` blocks."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from slipstream.config._base import StrictModel

__all__ = ["BF16Config", "DataTypesConfig", "FP16Config"]


class FP16Config(StrictModel):
    """fp16 mixed precision with loss scaling (Micikevicius et al. 2018)."""

    enabled: bool = False
    """Train the model in fp16 with fp32 master weights."""
    auto_cast: bool = False
    """Cast floating-point forward inputs to fp16."""
    loss_scale: float = Field(0.0, ge=0.0)
    """Static loss scale; 0 selects dynamic loss scaling."""
    initial_scale_power: int = Field(16, ge=0, le=64)
    """Dynamic scaling starts at 2**initial_scale_power."""
    loss_scale_window: int = Field(1000, ge=1)
    """Overflow-free steps before the dynamic scale doubles."""
    hysteresis: int = Field(2, ge=1)
    """Overflows tolerated before the scale is lowered."""
    consecutive_hysteresis: bool = False
    """Refill the hysteresis budget after every overflow-free step."""
    min_loss_scale: float = Field(1.0, gt=0.0)
    """The dynamic scale never drops below this."""
    fp16_master_weights_and_grads: bool = False
    """Keep master weights and gradients in fp16 (saves memory, loses precision)."""


class BF16Config(StrictModel):
    """bf16 mixed precision; no loss scaling is needed (same exponent range as fp32)."""

    enabled: bool = False
    """Train the model in bf16."""
    immediate_grad_update: bool = False
    """Accepted for compatibility (a DeepSpeed bf16-optimizer scheduling detail)."""
    check_grad_overflow: bool | None = None
    """Accepted for compatibility. slipstream checks the gradient norm for inf/nan in every
    precision (it is computed anyway) and skips or raises as ``nonfinite_gradients`` says;
    an explicit false cannot turn the check off (the loader warns)."""
    bf16_master_weights_and_grads: bool = False
    """Keep master weights and gradient accumulation in bf16 instead of fp32."""
    bf16_optimizer_states: bool = False
    """Keep optimizer states in bf16 (needs ``bf16_master_weights_and_grads``)."""


class DataTypesConfig(StrictModel):
    """``data_types``: dtype overrides."""

    grad_accum_dtype: Literal["fp32", "fp16", "bf16"] | None = None
    """Gradient accumulation dtype; None means fp32 (or bf16 with bf16 master weights)."""
