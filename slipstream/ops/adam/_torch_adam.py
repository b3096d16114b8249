"""DeepSpeed's Adam constructor arguments mapped onto ``torch.optim.Adam``.

DeepSpeed's ``FusedAdam`` (CUDA multi-tensor kernel) and ``DeepSpeedCPUAdam`` (vectorized C++)
compute the same update as torch's Adam, with weight decay either decoupled (AdamW, their
default) or added to the gradient (L2). torch's ``fused=True`` kernels (CPU and CUDA) are the
counterpart, so no op is built. The classes subclass ``torch.optim.Adam``: ZeRO treats them as
elementwise optimizers and their state dicts are torch's.

Arguments torch cannot honour are refused with the reason rather than ignored: AMSGrad
(DeepSpeed's FusedAdam raises for it too; its CPU Adam ignores it) and
``bias_correction=False`` (torch always corrects the moment estimates).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["adam_kwargs", "use_fused"]

_HAS_DECOUPLED = "decoupled_weight_decay" in inspect.signature(torch.optim.Adam).parameters


def adam_kwargs(
    cls_name: str,
    *,
    lr: float,
    bias_correction: bool,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    amsgrad: bool,
    decoupled: bool,
) -> dict[str, Any]:
    """Keyword arguments of ``torch.optim.Adam`` for DeepSpeed's; raises for what torch lacks."""
    if amsgrad:
        raise RuntimeError(
            f"{cls_name}(amsgrad=True): DeepSpeed's {cls_name} does not implement AMSGrad; use "
            "torch.optim.Adam(amsgrad=True) as a client optimizer if you want it"
        )
    if not bias_correction:
        raise ValueError(
            f"{cls_name}(bias_correction=False): torch's Adam always applies bias correction, "
            "so this update cannot be reproduced; drop the argument (True is the default)"
        )
    if decoupled and not _HAS_DECOUPLED:
        raise RuntimeError(
            f"{cls_name} in AdamW mode needs torch.optim.Adam(decoupled_weight_decay=...), "
            f"which torch {torch.__version__} lacks: upgrade torch or use torch.optim.AdamW"
        )
    kwargs: dict[str, Any] = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    if _HAS_DECOUPLED:
        kwargs["decoupled_weight_decay"] = decoupled
    return kwargs


def use_fused(params: Iterable[Any]) -> tuple[list[Any], bool]:
    """The materialized params and whether torch's fused kernel can take them all.

    The fused kernel needs floating-point tensors on one kind of device it supports; anything
    else (e.g. meta tensors before ZeRO-3 materializes them) gets the foreach path.
    """
    items = list(params)
    tensors = [
        t
        for item in items
        for t in (item["params"] if isinstance(item, dict) else [item])
        if isinstance(t, torch.Tensor)
    ]
    kinds = {t.device.type for t in tensors}
    fused = (
        bool(tensors)
        and len(kinds) == 1
        and kinds <= {"cpu", "cuda"}
        and all(t.is_floating_point() for t in tensors)
    )
    return items, fused
