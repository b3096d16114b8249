"""``deepspeed.ops.adam.DeepSpeedCPUAdam``: torch's fused CPU Adam with DeepSpeed's
constructor (used with ZeRO-Offload, where the optimizer runs on the host)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from slipstream.ops.adam._torch_adam import adam_kwargs, use_fused

__all__ = ["DeepSpeedCPUAdam"]


class DeepSpeedCPUAdam(torch.optim.Adam):
    """DeepSpeed's CPU Adam: AdamW by default (``adamw_mode=True``), Adam with L2 weight decay
    otherwise.

    ``fp32_optimizer_states`` is accepted: under slipstream's ZeRO the optimizer steps fp32
    master weights, so its moments are fp32 either way; on parameters of another dtype
    (without ZeRO) torch keeps the moments in the parameters' dtype, which is what
    DeepSpeed's ``fp32_optimizer_states=False`` asks for.
    """

    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
    ) -> None:
        kwargs = adam_kwargs(
            "DeepSpeedCPUAdam",
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            decoupled=adamw_mode,
        )
        items, fused = use_fused(model_params)
        super().__init__(items, fused=fused or None, **kwargs)
        self.adam_w_mode = int(adamw_mode)
        self.fp32_optimizer_states = fp32_optimizer_states
