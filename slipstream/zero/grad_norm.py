"""The global gradient norm of a ZeRO model: over data-, tensor- and pipeline-parallel ranks,
each element counted once.

Each rank holds the reduced gradient of its owned region of every bucket. Tensor-parallel
shards (:func:`~slipstream.distributed.placement.tp_shard`) hold different elements on every
TP rank, so their squares are summed over the TP group; replicated parameters are equal on
every TP rank and counted once; a pipeline-tied weight's second copy
(:func:`~slipstream.distributed.placement.is_duplicate`) is left out; each pipeline stage holds
different parameters, so the total is summed over the pipeline group.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from slipstream.distributed import comm
from slipstream.distributed.placement import is_duplicate, tp_shard
from slipstream.zero.flat import Bucket

__all__ = ["GradNorm"]

_TP_SHARD, _REPLICATED, _LEFT_OUT = 0, 1, 2


class GradNorm:
    """Computes the global L2 norm of the gradient shards the optimizer is about to apply.

    Args:
        buckets: the flat buckets.
        owned: per bucket, the ``[start, stop)`` region whose gradient this rank holds.
        dp_group: data-parallel group; the squares are summed over it when ``partitioned``.
        partitioned: each data-parallel rank holds a different region (stages 1-3).
        tp_group: tensor-parallel group, or None.
        pp_group: pipeline group, or None.
    """

    def __init__(
        self,
        buckets: Sequence[Bucket],
        owned: Sequence[tuple[int, int]],
        dp_group: comm.Group,
        partitioned: bool,
        tp_group: comm.Group = None,
        pp_group: comm.Group = None,
    ) -> None:
        self.dp_group, self.partitioned = dp_group, partitioned
        self.tp_group, self.pp_group = tp_group, pp_group
        self._parts = [self._segments(b, lo, hi) for b, (lo, hi) in zip(buckets, owned)]
        # MoE expert buckets at stage 0: each rank holds its own experts' whole gradients,
        # so their squares are summed over the expert-parallel group (at stages 1-3 the
        # data-parallel sum already counts every expert element once).
        self._expert_groups: list[comm.Group | None] = [
            b.expert.ep_group if b.expert is not None and not partitioned else None for b in buckets
        ]

    def _segments(self, bucket: Bucket, lo: int, hi: int) -> list[tuple[slice, int]] | None:
        """(slice of this rank's region, kind) per parameter; None when every parameter is
        replicated (the whole region counts once)."""
        if self.tp_group is None and self.pp_group is None:
            return None
        parts = []
        for i, p in enumerate(bucket.params):
            mine = bucket.param_slice(i, lo, hi)
            if mine:
                kind = _REPLICATED
                if is_duplicate(p):
                    kind = _LEFT_OUT
                elif tp_shard(p) is not None:
                    kind = _TP_SHARD
                parts.append((mine.at(lo), kind))
        return None if all(k == _REPLICATED for _, k in parts) else parts

    def __call__(self, grads: Sequence[torch.Tensor]) -> float:
        """The norm of ``grads`` (one per bucket, this rank's region of it).

        Every rank gets a non-finite result when any rank holds an inf/nan gradient, which
        is what lets the step skip (or raise) everywhere at once: the data-parallel squares
        are all-reduced at stages 1-3 (at stage 0 the gradients themselves were, and a sum
        keeps inf/nan), the tensor- and pipeline-parallel reductions carry them the rest of
        the way. Communication: at most one small all-reduce per group, none at stage 0
        without model parallelism.
        """
        device = grads[0].device if grads else torch.device("cpu")
        sq = torch.zeros(3, dtype=torch.float32, device=device)  # by kind
        experts: dict[int, tuple[comm.Group, torch.Tensor]] = {}
        for g, parts, ep_group in zip(grads, self._parts, self._expert_groups):
            acc = sq
            if ep_group is not None:  # by kind too: experts may be TP shards (expert TP)
                _, acc = experts.setdefault(id(ep_group), (ep_group, sq.new_zeros(3)))
            if parts is None:
                acc[_REPLICATED] += torch.linalg.vector_norm(g, dtype=torch.float32).square()
                continue
            for sl, kind in parts:
                acc[kind] += torch.linalg.vector_norm(g[sl], dtype=torch.float32).square()
        if self.partitioned:
            comm.all_reduce(sq, group=self.dp_group, label="grad_norm")
        for ep_group, acc in experts.values():
            comm.all_reduce(acc, group=ep_group, label="grad_norm_experts")
            sq += acc
        if self.tp_group is not None:
            # Replicated parameters are counted once, so their squares stay local; send
            # ``sq[1] * 0`` along (0 when finite, nan otherwise) so that a non-finite value on
            # one tensor-parallel rank reaches all of them in the same message.
            both = torch.stack([sq[_TP_SHARD], sq[_REPLICATED] * 0])
            comm.all_reduce(both, group=self.tp_group, label="grad_norm")
            sq[_TP_SHARD] = both[0]
            sq[_REPLICATED] += both[1]
        total = sq[:2].sum()
        if self.pp_group is not None:
            comm.all_reduce(total, group=self.pp_group, label="grad_norm")
        return float(total.sqrt())
