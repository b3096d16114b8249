"""``deepspeed.ops.adam.FusedAdam``: torch's fused Adam with DeepSpeed's constructor."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from slipstream.ops.adam._torch_adam import adam_kwargs, use_fused

__all__ = ["FusedAdam"]


class FusedAdam(torch.optim.Adam):
    """DeepSpeed's ``FusedAdam``: AdamW by default (``adam_w_mode=True``), Adam with L2 weight
    decay otherwise; torch's fused kernel where the parameters allow it, foreach elsewhere.

    ``set_grad_none`` is kept for compatibility: ``zero_grad()`` sets gradients to None, as
    DeepSpeed's does by default.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ) -> None:
        kwargs = adam_kwargs(
            "FusedAdam",
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            decoupled=adam_w_mode,
        )
        items, fused = use_fused(params)
        super().__init__(items, fused=fused or None, **kwargs)
        self.adam_w_mode = int(adam_w_mode)
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)
