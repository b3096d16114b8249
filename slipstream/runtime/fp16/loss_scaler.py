"""``deepspeed.runtime.fp16.loss_scaler``: static and dynamic loss scalers as DeepSpeed's.

``DynamicLossScaler.update_scale(overflow)`` follows DeepSpeed's rule step for step: on an
overflow the hysteresis counter drops by one, and once it is used up (or ``delayed_shift`` is
1) the scale halves, never below ``min_scale`` (at ``min_scale`` an overflow raises when
``raise_error_at_min_scale``); after ``scale_window`` consecutive steps without overflow the
scale doubles and the hysteresis refills (``consecutive_hysteresis`` refills it at every clean
step). slipstream's engine runs its own scaler (``slipstream.precision.LossScaler``, with the
same rule, configured by the ``fp16`` block); these classes are for code that drives a
scaler itself.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from slipstream._logging import log_rank0

__all__ = [
    "CONSECUTIVE_HYSTERESIS",
    "DELAYED_SHIFT",
    "INITIAL_LOSS_SCALE",
    "MIN_LOSS_SCALE",
    "SCALE_WINDOW",
    "CreateLossScaler",
    "DynamicLossScaler",
    "LossScaler",
    "LossScalerBase",
    "to_python_float",
]

INITIAL_LOSS_SCALE = "init_scale"
SCALE_WINDOW = "scale_window"
DELAYED_SHIFT = "delayed_shift"
CONSECUTIVE_HYSTERESIS = "consecutive_hysteresis"
MIN_LOSS_SCALE = "min_scale"


def to_python_float(t: Any) -> float:
    """A tensor's (or number's) value as a Python float."""
    return float(t.item() if hasattr(t, "item") else t)


def _has_inf_or_nan(x: torch.Tensor) -> bool:
    return not math.isfinite(float(x.float().sum()))


class LossScalerBase:
    """A loss scale: ``scale_loss`` multiplies, ``backward`` runs backward on the scaled loss."""

    def __init__(self, cur_scale: float) -> None:
        self.cur_scale = cur_scale
        self.dynamic = False

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def scale_gradient(self, module: Any, grad_in: Iterable[torch.Tensor], grad_out: Any) -> tuple:
        return tuple(self.loss_scale * g for g in grad_in)

    def update_scale(self, overflow: bool) -> None:
        """Static scalers keep their scale."""

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.loss_scale

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        self.scale_loss(loss).backward(retain_graph=retain_graph)


class LossScaler(LossScalerBase):
    """A static loss scale (``scale``); it never reports an overflow."""

    def __init__(self, scale: float = 1) -> None:
        super().__init__(scale)

    def has_overflow(self, params: Iterable[torch.nn.Parameter]) -> bool:
        return False


class DynamicLossScaler(LossScalerBase):
    """DeepSpeed's dynamic loss scaling (see the module docstring for the rule)."""

    def __init__(
        self,
        init_scale: float,
        scale_window: int,
        min_scale: float,
        delayed_shift: int,
        consecutive_hysteresis: bool,
        raise_error_at_min_scale: bool = True,
        dtype: torch.dtype = torch.half,
    ) -> None:
        super().__init__(init_scale)
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = 2.0
        self.scale_window = scale_window
        self.min_scale = min_scale
        self.delayed_shift = delayed_shift
        self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consecutive_hysteresis
        self.raise_error_at_min_scale = raise_error_at_min_scale
        self.dynamic = True
        self.dtype = dtype

    def has_overflow_serial(self, params: Iterable[torch.nn.Parameter]) -> bool:
        """Whether any gradient of ``params`` holds an inf or a NaN."""
        return any(p.grad is not None and _has_inf_or_nan(p.grad.data) for p in params)

    def has_overflow(self, params: Iterable[torch.nn.Parameter]) -> bool:
        return self.has_overflow_serial(params)

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
                    raise RuntimeError(
                        "Current loss scale already at minimum - cannot decrease scale anymore "
                        f"(min_scale={self.min_scale}); the gradients overflow at every scale"
                    )
                new = max(self.cur_scale / self.scale_factor, self.min_scale)
                log_rank0("OVERFLOW: skipping step; loss scale %s -> %s", self.cur_scale, new)
                self.cur_scale = new
            else:
                log_rank0("OVERFLOW: skipping step; hysteresis %d", self.cur_hysteresis - 1)
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable = self.cur_iter - self.last_overflow_iter - 1
            if stable > 0 and stable % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1


def CreateLossScaler(
    dtype: torch.dtype,
    static_loss_scale: float,
    dynamic_scaling: bool,
    dynamic_loss_args: dict[str, Any] | None,
) -> LossScalerBase:
    """A dynamic scaler for fp16 with ``dynamic_scaling``, else a static one (scale 1 for
    other dtypes).

    Raises:
        ValueError: dynamic fp16 scaling without ``dynamic_loss_args``.
    """
    if dtype == torch.half and dynamic_scaling:
        if dynamic_loss_args is None:
            raise ValueError("Dynamic loss scaling parameters must be defined (dynamic_loss_args)")
        return DynamicLossScaler(dtype=dtype, **dynamic_loss_args)
    return LossScaler(scale=static_loss_scale if dtype == torch.half else 1.0)
