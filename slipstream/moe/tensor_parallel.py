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

from torch import Tensor, nn

from slipstream.distributed import comm
from slipstream.moe.dispatch import exchange_and_run, exchange_split_experts
from slipstream.moe.tp_rows import DropRows, GatherRows, tp_piece_counts, tp_pieces

__all__ = ["TPTokenSplit", "exchange_split_experts", "sum_expert_grads_over_tp_", "tp_pieces"]


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
        mine = tp_piece_counts(counts, tp_size, tp_rank)
        piece = DropRows.apply(rows, pieces, self.tp_group)
        out = exchange_and_run(experts, piece, mine, ep_size, group)
        full: Tensor = GatherRows.apply(out, pieces, self.tp_group)
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
