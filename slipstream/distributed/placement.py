"""How a parameter is placed over the parallel ranks: one typed record per parameter.

Tensor parallelism (``slipstream.parallel``) writes it when it splits a weight, the pipeline
marks the second copy of a tied weight, and ZeRO's gradient norm and the checkpoint writer read
it. It lives here, below all of them, so each reads the same record instead of ad-hoc
attributes. The record hangs on the parameter under one private attribute (tensors cannot be
dict keys: a lookup may compare them with ``==``) and is frozen: writers replace it, so a
record copied along with a parameter's ``__dict__`` (``zero.Init``'s meta swap) is never
changed behind the copy's back.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

__all__ = [
    "Placement",
    "TPShard",
    "is_duplicate",
    "mark_duplicate_",
    "mark_tp_grad_summed_",
    "placement",
    "set_tp_shard_",
    "tp_grad_summed",
    "tp_shard",
]

_ATTR = "_slipstream_placement"


@dataclass(frozen=True)
class TPShard:
    """This rank's slice of a tensor-parallel weight (Megatron-LM's column/row split).

    Attributes:
        dim: dimension of the logical weight that is split.
        parts: equal blocks concatenated along ``dim`` (3 for a fused q|k|v weight); each
            block is split separately and this rank holds its slice of every block, in order.
        rank: this rank's index in the tensor-parallel group.
        size: tensor-parallel group size.
    """

    dim: int
    parts: int
    rank: int
    size: int


@dataclass(frozen=True)
class Placement:
    """Everything parallelism records about one parameter.

    Attributes:
        tp: the tensor-parallel slice this parameter holds, or None when it is replicated.
        duplicate: another rank holds the copy that counts (a pipeline-tied weight on a stage
            that does not own it): left out of the gradient norm and not written to
            checkpoints.
        tp_grad_summed: a hook already sums this replicated parameter's gradient over the
            tensor-parallel group (sequence-parallel norms; a tied norm must get one hook).
    """

    tp: TPShard | None = None
    duplicate: bool = False
    tp_grad_summed: bool = False


_REPLICATED = Placement()


def placement(p: torch.Tensor) -> Placement:
    """``p``'s record (an ordinary replicated parameter's when nothing was recorded)."""
    found = p.__dict__.get(_ATTR)
    return found if isinstance(found, Placement) else _REPLICATED


def _set(p: torch.Tensor, record: Placement) -> None:
    p.__dict__[_ATTR] = record


def set_tp_shard_(p: torch.Tensor, shard: TPShard) -> None:
    """Record that ``p`` now holds ``shard`` of its logical weight."""
    _set(p, replace(placement(p), tp=shard))


def mark_duplicate_(p: torch.Tensor) -> None:
    """Record that another rank holds the copy of ``p`` that counts (see ``Placement``)."""
    _set(p, replace(placement(p), duplicate=True))


def mark_tp_grad_summed_(p: torch.Tensor) -> None:
    """Record that a hook sums ``p``'s gradient over the tensor-parallel group."""
    _set(p, replace(placement(p), tp_grad_summed=True))


def tp_shard(p: torch.Tensor) -> TPShard | None:
    """The tensor-parallel slice ``p`` holds, or None when it is replicated."""
    return placement(p).tp


def is_duplicate(p: torch.Tensor) -> bool:
    return placement(p).duplicate


def tp_grad_summed(p: torch.Tensor) -> bool:
    return placement(p).tp_grad_summed
