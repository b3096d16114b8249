"""The released-parameter contract of ZeRO-3 (DeepSpeed's ``ds_*`` attributes).

A partitioned parameter outside its use is an *empty* tensor (``numel() == 0``, shape
``(0,)``) on its device and dtype: reading it (``p.norm()``, ``print(p)``, ``p.sum()``,
``torch.isnan(p).any()``) is safe and sees no elements, never freed memory. What it stands for
is kept on the parameter itself, under the names DeepSpeed uses and that DeepSpeed-aware code
(Hugging Face transformers, PEFT, TRL) reads:

- ``ds_shape`` / ``ds_numel``: the full shape and number of elements;
- ``ds_status``: :class:`ZeroParamStatus` (``AVAILABLE`` while gathered, ``INFLIGHT`` while a
  prefetch is in flight, ``NOT_AVAILABLE`` otherwise);
- ``ds_id``: a number equal on every rank for the same parameter;
- ``ds_tensor``: this rank's shard, a 1-D tensor (its length depends on the layout: an equal
  padded slice of the parameter under ``zero.Init``, the parameter's part of this rank's
  flat-bucket shard after ``initialize``; possibly empty).

``GatheredParameters`` gives the full values for a block. A parameter whose ``ds_*`` attributes
were set by another ZeRO-3 implementation (a real DeepSpeed) is refused with an error.
"""

from __future__ import annotations

import enum
import itertools
from typing import Any

import torch
from torch import nn

__all__ = [
    "ZeroParamStatus",
    "full_numel",
    "full_shape",
    "is_zero_param",
]

# Which slipstream object manages a partitioned parameter: a ZeRO-3 store and unit after
# initialize (a ``UnitOwner``, read with ``sharded_store.unit_owner``) or a zero.Init partition
# before (read with ``init_shards.init_owner``). Tensors must not be dict keys (== would read
# them), so the record hangs on the parameter; only those two accessors read it.
OWNER_ATTR = "_slipstream_z3_owner"
INIT_OWNER_ATTR = "_slipstream_init_owner"
EXTERNAL_ATTR = "_slipstream_z3_external"  # register_external_parameter's list, per module
_DS_ATTRS = ("ds_id", "ds_shape", "ds_numel", "ds_status", "ds_tensor")
_ids = itertools.count()


class ZeroParamStatus(enum.Enum):
    """Whether a partitioned parameter's full values are present (DeepSpeed's values)."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


def is_zero_param(p: torch.Tensor) -> bool:
    """True for a parameter partitioned by ZeRO-3 (DeepSpeed's test: it has ``ds_id``)."""
    return hasattr(p, "ds_id")


def full_shape(p: torch.Tensor) -> torch.Size:
    """The parameter's real shape, also while it is released."""
    return torch.Size(getattr(p, "ds_shape", p.shape))


def full_numel(p: torch.Tensor) -> int:
    return int(getattr(p, "ds_numel", p.numel()))


def is_slipstream_partitioned(p: torch.Tensor) -> bool:
    return hasattr(p, OWNER_ATTR) or hasattr(p, INIT_OWNER_ATTR)


def mark_partitioned_(
    p: nn.Parameter, shape: torch.Size, shard: torch.Tensor | None, ds_id: int | None = None
) -> None:
    """Give ``p`` the ``ds_*`` attributes (keeping its ``ds_id`` if it had one)."""
    if not hasattr(p, "ds_id"):
        p.ds_id = next(_ids) if ds_id is None else ds_id  # type: ignore[attr-defined]
    p.ds_shape = torch.Size(shape)  # type: ignore[attr-defined]
    p.ds_numel = p.ds_shape.numel()  # type: ignore[attr-defined]
    p.ds_tensor = shard  # type: ignore[attr-defined]
    if not hasattr(p, "ds_status"):
        p.ds_status = ZeroParamStatus.NOT_AVAILABLE  # type: ignore[attr-defined]


def unmark_(p: nn.Parameter) -> None:
    """Drop the ``ds_*`` attributes: ``p`` is an ordinary (replicated) parameter again."""
    for name in _DS_ATTRS:
        p.__dict__.pop(name, None)
    p.__dict__.pop(INIT_OWNER_ATTR, None)


def bind_(p: nn.Parameter, data: torch.Tensor) -> None:
    """Point ``p`` at its full values (a view of gathered storage): ``AVAILABLE``.

    ``.data`` assignment keeps the parameter's identity, so tensors autograd saved in forward
    (the parameter itself) see the values again when backward re-gathers them.
    """
    p.data = data
    p.ds_status = ZeroParamStatus.AVAILABLE  # type: ignore[attr-defined]


def release_(p: nn.Parameter, empty: torch.Tensor) -> None:
    """Make ``p`` the empty placeholder ``empty`` (0 elements, same dtype and device)."""
    p.data = empty
    p.ds_status = ZeroParamStatus.NOT_AVAILABLE  # type: ignore[attr-defined]


def empty_like_released(p: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.empty(0, dtype=dtype or p.dtype, device=p.device)


def foreign_partition_error(name: str, p: Any) -> RuntimeError:
    """The error for a parameter partitioned by another ZeRO-3 implementation."""
    return RuntimeError(
        f"parameter '{name}' (ds_shape {tuple(getattr(p, 'ds_shape', ()))}, ds_status "
        f"{getattr(p, 'ds_status', None)}) was partitioned by another ZeRO-3 implementation "
        "(e.g. built under deepspeed.zero.Init), not by slipstream: slipstream cannot gather "
        "it. Build the model under slipstream.zero.Init (or `import slipstream as deepspeed`), "
        "or build it without any zero.Init"
    )


def check_not_foreign(named: Any) -> None:
    """Raise :func:`foreign_partition_error` for the first foreign-partitioned parameter of
    ``named`` (an iterable of (name, tensor))."""
    for name, p in named:
        if is_zero_param(p) and not is_slipstream_partitioned(p):
            raise foreign_partition_error(name, p)
