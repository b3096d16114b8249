"""Which optimizers may run on flat ZeRO partitions.

ZeRO hands the optimizer flat slices of many parameters. That is exact for *elementwise*
optimizers (each element's update depends only on that element's gradient and state: Adam,
SGD, Lion, ...). *Layer-wise* optimizers compute per-parameter statistics (LAMB's trust ratio,
Adafactor's factored second moment over a matrix) and are exact only when every parameter is
one whole tensor on one rank.
"""

from __future__ import annotations

from typing import Literal

import torch

from slipstream.optim.lamb import Lamb
from slipstream.optim.lion import Lion

__all__ = ["OptimizerKind", "optimizer_kind"]

OptimizerKind = Literal["elementwise", "layerwise", "unknown"]

_ELEMENTWISE: tuple[type, ...] = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.SGD,
    torch.optim.Adagrad,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Rprop,
    torch.optim.ASGD,
    torch.optim.Adadelta,
    Lion,
)
_LAYERWISE: tuple[type, ...] = tuple(
    c
    for c in (
        Lamb,
        getattr(torch.optim, "Adafactor", None),
        torch.optim.LBFGS,
        torch.optim.SparseAdam,
    )
    if c
)


def optimizer_kind(cls: type) -> OptimizerKind:
    """Classify an optimizer class (subclasses inherit their base's kind)."""
    if issubclass(cls, _LAYERWISE):
        return "layerwise"
    if issubclass(cls, _ELEMENTWISE):
        return "elementwise"
    return "unknown"
