"""Rows replicated over a tensor-parallel group, shared out and gathered back.

Under tensor parallelism every TP rank holds the same rows; :func:`tp_pieces` gives each TP
rank its share, :class:`DropRows` keeps it and :class:`GatherRows` all-gathers the shares back
into the full rows (each the other's gradient, as DeepSpeed's ``drop_tokens`` and
``gather_tokens``). Used by ``slipstream.moe.tensor_parallel`` and ``slipstream.moe.dispatch``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from slipstream.distributed import comm

__all__ = ["DropRows", "GatherRows", "tp_piece_counts", "tp_pieces"]


def tp_pieces(counts: Tensor, tp_size: int) -> list[Tensor]:
    """Per TP rank, the positions of the rows it computes, in row order.

    ``counts [experts]``: rows per expert, the rows sorted by expert. Rank ``r`` takes rows
    ``[c*r // tp, c*(r+1) // tp)`` of each expert's block of ``c`` rows, so every rank gets
    an even share of every expert's load (a block smaller than ``tp`` leaves some ranks none).
    """
    n = int(counts.sum())
    expert = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)
    start = torch.cumsum(counts, 0) - counts
    within = torch.arange(n, device=counts.device) - start[expert]
    c = counts[expert]
    # The r with c*r//tp <= within < c*(r+1)//tp: ceil((within + 1) * tp / c) - 1.
    owner = ((within + 1) * tp_size + c - 1) // c - 1
    return [torch.nonzero(owner == r).reshape(-1) for r in range(tp_size)]


def tp_piece_counts(counts: Tensor, tp_size: int, tp_rank: int) -> Tensor:
    """Rows per expert in TP rank ``tp_rank``'s piece (:func:`tp_pieces`): of a block of
    ``c`` rows it takes ``c*(r+1)//tp - c*r//tp``."""
    return counts * (tp_rank + 1) // tp_size - counts * tp_rank // tp_size


def _gather(piece: Tensor, pieces: list[Tensor], group: comm.Group) -> Tensor:
    """Every rank's ``piece`` put back at its positions ``pieces[r]`` of the full rows."""
    sizes = [int(p.numel()) for p in pieces]
    longest = max(sizes)
    width = piece.shape[1:]
    padded = piece.new_zeros((longest, *width))
    padded[: piece.shape[0]] = piece
    flat = piece.new_empty((len(sizes) * longest * padded[0].numel(),))
    comm.all_gather_into_tensor(flat, padded.reshape(-1), group=group, label="moe_tp_gather")
    slots = flat.reshape(len(sizes), longest, *width)
    full = piece.new_empty((sum(sizes), *width))
    for r, where in enumerate(pieces):
        full[where] = slots[r, : sizes[r]]
    return full


class DropRows(torch.autograd.Function):
    """Keep this TP rank's rows; the gradient of the full rows is the TP all-gather."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, rows: Tensor, pieces: list[Tensor], group: comm.Group
    ) -> Tensor:
        ctx.pieces, ctx.group = pieces, group
        return rows[pieces[comm.get_rank(group)]]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        return _gather(grad.contiguous(), ctx.pieces, ctx.group), None, None


class GatherRows(torch.autograd.Function):
    """All TP ranks' rows back in full; the gradient is this rank's rows of it."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, piece: Tensor, pieces: list[Tensor], group: comm.Group
    ) -> Tensor:
        ctx.mine = pieces[comm.get_rank(group)]
        return _gather(piece.contiguous(), pieces, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        return grad[ctx.mine], None, None
