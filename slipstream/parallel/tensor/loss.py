"""The loss from vocabulary-sharded logits: the LM head is column-parallel over the vocabulary
and :func:`vocab_parallel_cross_entropy` computes the mean cross-entropy from the shards
without building the full ``[tokens, vocab]`` tensor on any rank (Megatron-LM's parallel
cross-entropy). :class:`VocabParallelOutput` is the module a model's plan swaps in for its
output step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from slipstream.distributed import comm
from slipstream.parallel.tensor.collectives import gather_from_tp

__all__ = ["VocabParallelOutput", "vocab_parallel_cross_entropy"]


class _VocabParallelCE(torch.autograd.Function):
    """Mean cross-entropy from vocabulary-sharded logits [N, V/tp].

    Three small all-reduces of per-token values (max; target logit and sum of exponentials):
    no rank ever holds more than its [N, V/tp] shard, and backward reuses the saved local
    softmax in place.
    """

    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, labels: torch.Tensor, group: comm.Group, ignore: int
    ) -> torch.Tensor:
        vl = logits.shape[-1]
        start = comm.get_rank(group) * vl
        x = logits.float()
        x = x.clone() if x is logits else x  # work in place on our own fp32 copy
        row_max = x.max(dim=-1).values
        comm.all_reduce(row_max, op=comm.ReduceOp.MAX, group=group, label="tp_ce")
        x.sub_(row_max.unsqueeze(-1))
        mine = (labels >= start) & (labels < start + vl)
        idx = (labels - start).clamp(0, vl - 1).unsqueeze(-1)
        target = x.gather(-1, idx).squeeze(-1) * mine
        x.exp_()
        sums = torch.stack((target, x.sum(dim=-1)))
        comm.all_reduce(sums, group=group, label="tp_ce")
        target, sum_exp = sums[0], sums[1]
        valid = labels != ignore
        count = valid.sum().clamp(min=1)
        loss = ((sum_exp.log() - target) * valid).sum() / count
        x.div_(sum_exp.unsqueeze(-1))  # softmax of this rank's vocabulary slice
        ctx.save_for_backward(x, idx, mine, valid, count)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        softmax, idx, mine, valid, count = ctx.saved_tensors
        g = softmax  # saved once, used once: update in place
        g.scatter_add_(-1, idx, -mine.unsqueeze(-1).to(g.dtype))
        g.mul_((valid.to(g.dtype) * (grad / count)).unsqueeze(-1))
        return g.to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, group: comm.Group, ignore_index: int = -100
) -> torch.Tensor:
    """Mean token cross-entropy from this rank's vocabulary slice of the logits.

    Args:
        logits: [..., V/tp] logits of vocabulary rows [rank * V/tp, (rank + 1) * V/tp).
        labels: [...] target ids in [0, V) (``ignore_index`` marks positions to skip).
        group: the tensor-parallel group (slices in rank order).

    Returns:
        The mean over non-ignored positions, equal on every TP rank; the same value as
        ``F.cross_entropy`` on the gathered logits.
    """
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"vocab_parallel_cross_entropy: labels of shape {tuple(labels.shape)} do not match "
            f"logits of shape {tuple(logits.shape)} (expected labels {tuple(logits.shape[:-1])})"
        )
    flat = logits.reshape(-1, logits.shape[-1])
    return _VocabParallelCE.apply(flat, labels.reshape(-1), group, ignore_index)


class VocabParallelOutput(nn.Module):
    """A language model's output step on vocabulary-sharded logits ``[..., V/tp]``.

    ``forward(logits, labels)``: the mean token cross-entropy over ``tp_group`` when labels are
    given (:func:`vocab_parallel_cross_entropy`), else the full logits gathered from the TP
    ranks. Installed by a model's tensor-parallel plan in place of its local output step, so
    the model itself never holds the group.
    """

    def __init__(self, tp_group: comm.Group) -> None:
        super().__init__()
        self.tp_group = tp_group

    def forward(self, logits: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if labels is None:
            return gather_from_tp(logits, self.tp_group)
        return vocab_parallel_cross_entropy(logits, labels, self.tp_group)
