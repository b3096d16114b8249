"""Mixed-precision policy and loss scaling.

bf16 (default policy): the model computes in bf16; fp32 master weights and fp32 gradient
accumulation live in the ZeRO optimizer, so small updates are not lost to bf16 rounding.
``bf16.bf16_master_weights_and_grads`` switches both to bf16 to save memory.
fp16: as bf16 plus a loss scale so small gradients do not underflow; steps whose gradients
overflow are skipped and the dynamic scale is lowered (Micikevicius et al. 2018, section 3.2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slipstream.config.precision import BF16Config, DataTypesConfig, FP16Config

__all__ = [
    "LossScaler",
    "NonFiniteGradientError",
    "PrecisionPolicy",
    "nonfinite_error_message",
    "skipped_step_message",
]

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class PrecisionPolicy:
    """Which dtype each copy of the model state uses.

    Attributes:
        param_dtype: dtype of the module's parameters (forward/backward compute).
        master_dtype: dtype of the weights the optimizer updates.
        grad_accum_dtype: dtype gradients are accumulated and reduced in.
        reduce_dtype: dtype on the wire for gradient reduction.
    """

    param_dtype: torch.dtype = torch.float32
    master_dtype: torch.dtype = torch.float32
    grad_accum_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32

    @classmethod
    def from_config(
        cls,
        fp16: FP16Config,
        bf16: BF16Config,
        data_types: DataTypesConfig,
        communication_data_type: str | None,
        model_dtype: torch.dtype,
    ) -> PrecisionPolicy:
        """Derive the policy from the config blocks; fp32 models keep everything in fp32."""
        if fp16.enabled:
            param, master, accum = torch.float16, torch.float32, torch.float32
        elif bf16.enabled:
            param = torch.bfloat16
            low = bf16.bf16_master_weights_and_grads
            master = torch.bfloat16 if low else torch.float32
            accum = torch.bfloat16 if low else torch.float32
        else:
            param = master = accum = model_dtype
        if data_types.grad_accum_dtype is not None:
            accum = _DTYPES[data_types.grad_accum_dtype]
        reduce = _DTYPES[communication_data_type] if communication_data_type else accum
        return cls(param, master, accum, reduce)


class NonFiniteGradientError(FloatingPointError):
    """The global gradient norm of a step is inf or nan and ``nonfinite_gradients`` is
    ``"error"``. Raised on every rank at the same step (the norm is reduced over all of
    them); the step was not applied."""


def skipped_step_message(step: int, norm: float | None, scaler: LossScaler) -> str:
    """The log line for a step skipped because its gradients are not finite.

    Only dynamic fp16 scaling names a loss scale: fp32 and bf16 have none.
    """
    if scaler.dynamic:
        return (
            f"step {step} skipped: gradient overflow (grad norm {norm}); loss scale is now "
            f"{scaler.scale}"
        )
    return (
        f"step {step} skipped: the global gradient norm is {norm} (an inf/nan loss or "
        "gradient on at least one rank); parameters, optimizer state and the lr schedule "
        "are unchanged on every rank"
    )


def nonfinite_error_message(step: int, norm: float | None) -> str:
    """The message of ``NonFiniteGradientError``."""
    return (
        f"step {step}: the global gradient norm is {norm} (an inf/nan loss or gradient on at "
        "least one rank); the step was not applied. Look for the first non-finite loss or "
        'activation (lower the lr, check the data), or set "nonfinite_gradients": "skip" '
        "to skip such steps with a warning"
    )


class LossScaler:
    """Static or dynamic loss scale with DeepSpeed's hysteresis semantics.

    Dynamic: starts at 2**initial_scale_power; an overflow consumes one unit of hysteresis,
    and when none is left halves the scale (not below ``min_loss_scale``); every
    ``loss_scale_window`` overflow-free steps doubles it.
    """

    def __init__(self, cfg: FP16Config | None) -> None:
        self.enabled = cfg is not None and cfg.enabled
        self.dynamic = self.enabled and cfg is not None and cfg.loss_scale == 0
        if cfg is None or not self.enabled:
            self.scale = 1.0
            return
        self.scale = float(2**cfg.initial_scale_power) if self.dynamic else cfg.loss_scale
        self.window = cfg.loss_scale_window
        self.min_scale = cfg.min_loss_scale
        self.hysteresis = cfg.hysteresis
        self.consecutive_hysteresis = cfg.consecutive_hysteresis
        self.cur_hysteresis = cfg.hysteresis
        self.iteration = 0
        self.last_overflow_iter = -1

    def update(self, overflow: bool) -> None:
        """Advance one optimizer step; adjust a dynamic scale."""
        if not self.dynamic:
            return
        if overflow:
            if self.hysteresis == 1 or self.cur_hysteresis == 1:
                self.scale = max(self.scale / 2, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.iteration
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.hysteresis
            if (self.iteration - self.last_overflow_iter) % self.window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.hysteresis
                self.scale *= 2.0
        self.iteration += 1

    def state_dict(self) -> dict[str, float | int]:
        if not self.dynamic:
            return {"scale": self.scale}
        return {
            "scale": self.scale,
            "cur_hysteresis": self.cur_hysteresis,
            "iteration": self.iteration,
            "last_overflow_iter": self.last_overflow_iter,
        }

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale = float(state["scale"])
        if self.dynamic:
            self.cur_hysteresis = int(state["cur_hysteresis"])
            self.iteration = int(state["iteration"])
            self.last_overflow_iter = int(state["last_overflow_iter"])
