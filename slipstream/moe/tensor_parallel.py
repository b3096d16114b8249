"""MoE layers inside a tensor-parallel model: each token computed once per TP group.

Under Megatron-style tensor parallelism the residual stream is replicated over the TP group,
so every TP rank enters an MoE layer with the same tokens and, the gate being replicated, the
same routes. DeepSpeed-MoE (``deepspeed/moe/mappings.py``, ``drop_tokens``/``gather_tokens``)
removes the duplicates before the all-to-all and restores them after; slipstream does the same
on its sorted rows:

- **experts replicated over TP** (``enable_expert_tensor_parallelism=False``): TP rank ``r``
  keeps the ``r``-th of ``tp`` near-equal pieces of every expert's block of rows
  (:func:`tp_pieces`), sends only those through the expert-parallel all-to-all and runs the
  experts on them; the results are all-gathered over the TP group back into the full row
  order. Each TP rank's copy of an expert then sees a different part of the tokens, so its
  gradient is summed over the TP group (:func:`sum_expert_grads_over_tp_`) before the usual
  expert-data-parallel reduction. The all-to-all volume and the expert work per rank drop
  by ``tp``.
- **expert tensor parallelism** (``enable_expert_tensor_parallelism=True``): each expert's
  MLP is split column/row-wise over the TP group like the dense MLP (by the TP plan), and its
  row-parallel layer sums the partial outputs; every TP rank runs its slice of the experts on
  all the tokens. With ``ep_size`` > 1 (:func:`exchange_split_experts`) TP rank ``r`` still
  sends only its pieces through the all-to-all; the receiving ranks all-gather what their TP
  group received, run their expert slices on all of it, keep their own received rows of the
  outputs and send those back, and the returned pieces are all-gathered over TP. The
  all-to-all volume drops by ``tp``; the expert work per rank does not.

``DroplessMoE`` and AutoEP layers keep their grouped experts whole on every TP rank; with
``ep_size`` > 1 they take the first form (their ``exchange`` is a :class:`TPTokenSplit`).

The drop's gradient is the all-gather and the gather's gradient is the drop (each TP rank
holds the same, replicated gradient downstream), as in DeepSpeed's mappings.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from slipstream.distributed import comm
from slipstream.moe.dispatch import (
    _blocks_in_order,
    all_to_all_uneven,
    exchange_and_run,
    run_local_experts,
)

__all__ = ["TPTokenSplit", "exchange_split_experts", "sum_expert_grads_over_tp_", "tp_pieces"]


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


class _DropRows(torch.autograd.Function):
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


class _GatherRows(torch.autograd.Function):
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


class TPTokenSplit:
    """``exchange_and_run`` for experts replicated over a TP group: each TP rank computes
    its pieces of every expert's rows (:func:`tp_pieces`), the outputs are all-gathered.

    Communication per layer and direction: one all-gather over the TP group of the expert
    outputs (padded to the largest piece), on top of the expert-parallel all-to-alls, which
    carry ``1/tp`` of the rows.
    """

    def __init__(self, tp_group: comm.Group) -> None:
        self.tp_group = tp_group

    def __call__(
        self, experts: nn.Module, rows: Tensor, counts: Tensor, ep_size: int, group: comm.Group
    ) -> Tensor:
        tp_size, tp_rank = comm.get_world_size(self.tp_group), comm.get_rank(self.tp_group)
        pieces = tp_pieces(counts, tp_size)
        expert = torch.repeat_interleave(torch.arange(counts.numel(), device=rows.device), counts)
        mine = torch.bincount(expert[pieces[tp_rank]], minlength=counts.numel())
        piece = _DropRows.apply(rows, pieces, self.tp_group)
        out = exchange_and_run(experts, piece, mine, ep_size, group)
        full: Tensor = _GatherRows.apply(out, pieces, self.tp_group)
        return full


def exchange_split_experts(
    experts: nn.Module,
    rows: Tensor,
    counts: Tensor,
    ep_size: int,
    group: comm.Group,
    tp_group: comm.Group,
) -> Tensor:
    """``exchange_and_run`` for experts split over ``tp_group`` (expert TP), ``ep_size`` > 1.

    ``rows`` (sorted by global expert, ``counts [experts]``) are the same on every TP rank.
    Rank ``r`` sends its :func:`tp_pieces` share through the expert-parallel all-to-all; the
    rows its TP group received are all-gathered (in TP-rank, source-rank, local-expert order)
    so each expert slice sees all of them; rank ``r`` keeps its received rows of the outputs,
    sends them back, and the pieces are all-gathered over TP into the full row order.

    Communication per layer and direction: two all-to-alls over the expert-parallel group with
    ``1/tp`` of the rows, two all-gathers over the TP group (padded to the largest share), and
    one small all-gather of the received counts.
    """
    tp_size, tp_rank = comm.get_world_size(tp_group), comm.get_rank(tp_group)
    num = counts.numel()
    local = num // ep_size
    pieces = tp_pieces(counts, tp_size)
    expert = torch.repeat_interleave(torch.arange(num, device=rows.device), counts)
    sent = torch.bincount(expert[pieces[tp_rank]], minlength=num).reshape(ep_size, local)
    got = torch.empty_like(sent)
    comm.all_to_all_single(got, sent.contiguous(), group=group, label="moe_counts")
    every = got.new_empty((tp_size * ep_size * local,))
    comm.all_gather_into_tensor(every, got.reshape(-1), group=tp_group, label="moe_tp_counts")
    sizes: list[list[int]] = every.reshape(tp_size * ep_size, local).tolist()
    send = sent.sum(1).tolist()
    recv = [sum(row) for row in sizes[tp_rank * ep_size : (tp_rank + 1) * ep_size]]
    piece = _DropRows.apply(rows, pieces, tp_group)
    received = all_to_all_uneven(piece, send, recv, group)
    # Where each TP rank's received rows sit in the gathered rows: one block per TP rank.
    totals = [
        sum(sum(row) for row in sizes[r * ep_size : (r + 1) * ep_size]) for r in range(tp_size)
    ]
    starts = [sum(totals[:r]) for r in range(tp_size)]
    blocks = [
        torch.arange(starts[r], starts[r] + totals[r], device=rows.device) for r in range(tp_size)
    ]
    gathered = _GatherRows.apply(received, blocks, tp_group)
    # (TP rank, source rank, local expert) order to (local expert, ...) and back.
    per_expert = [sum(row[e] for row in sizes) for e in range(local)]
    out = run_local_experts(experts, _blocks_in_order(gathered, sizes, True), per_expert)
    out = _DropRows.apply(_blocks_in_order(out, sizes, False), blocks, tp_group)
    back = all_to_all_uneven(out, recv, send, group)
    full: Tensor = _GatherRows.apply(back, pieces, tp_group)
    return full


def sum_expert_grads_over_tp_(experts: nn.Module, tp_group: comm.Group) -> None:
    """Sum the gradients of ``experts``' (TP-replicated) parameters over ``tp_group`` as they
    are produced: each TP rank computed its own part of the tokens (:class:`TPTokenSplit`).

    One all-reduce per parameter and backward; a parameter gets the hook once.
    """
    for p in experts.parameters():
        if not p.requires_grad or getattr(p, "_moe_tp_grad_summed", False):
            continue
        p._moe_tp_grad_summed = True  # type: ignore[attr-defined]
        p.register_hook(_tp_sum(tp_group))


def _tp_sum(group: comm.Group) -> Any:
    def hook(grad: Tensor) -> Tensor:
        out = grad.clone()
        comm.all_reduce(out, group=group, label="moe_tp_expert_grads")
        return out

    return hook
