"""Token dispatch and combine: local grouping by expert, all-to-all across expert-parallel ranks.

DeepSpeed-MoE (and GShard before it) scatters every token into a ``[experts, capacity, d]``
buffer, padded to the capacity, and exchanges that whole buffer with an all-to-all. Here only
the tokens that are kept travel and get computed:

1. the kept ``(token, choice)`` pairs are stably sorted by expert, so every expert's tokens are
   one contiguous block (``counts[e]`` rows);
2. with expert parallelism, the per-expert counts are exchanged first (one small all-to-all),
   then the tokens with an all-to-all of uneven splits: a rank may send any number of tokens,
   none included, and no rank waits on a size it did not agree to;
3. every local expert runs once on its block (also an empty one, so its gradients exist and
   the gradient reduction sees the same parameters on every rank);
4. the results travel back by the reverse all-to-all and are summed into their tokens,
   weighted by the gate, in fp32.

The result equals the capacity-buffer formulation on the same routes (no padding rows are
computed; rows are independent in an expert), with ``tokens * k`` rows of expert work instead
of ``experts * capacity``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from slipstream.distributed import comm
from slipstream.moe.gating import Routes
from slipstream.moe.tp_rows import DropRows, GatherRows, tp_piece_counts, tp_pieces

__all__ = [
    "MOELayer",
    "RoutingStats",
    "all_to_all_uneven",
    "combine",
    "exchange_split_experts",
    "gather_tokens",
    "group_by_expert",
]


class _AllToAllUneven(torch.autograd.Function):
    """All-to-all of rows with per-rank split sizes; its gradient is the reverse exchange."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, send: list[int], recv: list[int], group: comm.Group
    ) -> Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        comm.all_to_all_single(out, x.contiguous(), recv, send, group=group, label="moe_a2a")
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:  # type: ignore[override]
        return _AllToAllUneven.apply(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def all_to_all_uneven(x: Tensor, send: list[int], recv: list[int], group: comm.Group) -> Tensor:
    """Send ``send[r]`` consecutive rows of ``x`` to rank ``r``; receive ``recv[r]`` from it."""
    out: Tensor = _AllToAllUneven.apply(x, send, recv, group)
    return out


@dataclass
class RoutingStats:
    """What a layer's router did in its last forward (for monitors and tests).

    Attributes:
        tokens_per_expert: ``[experts]`` choices routed to each expert before dropping.
        kept_per_expert: ``[experts]`` choices each expert computed.
        dropped_fraction: dropped choices / all choices (0 when dropless).
        imbalance: busiest expert's routed load over the mean load (1.0 is perfect balance).
    """

    tokens_per_expert: Tensor
    kept_per_expert: Tensor
    dropped_fraction: float
    imbalance: float

    @staticmethod
    def of(routed: Tensor, kept: Tensor) -> RoutingStats:
        total = float(routed.sum())
        mean = total / max(routed.numel(), 1)
        return RoutingStats(
            routed.detach().cpu(),
            kept.detach().cpu(),
            1.0 - float(kept.sum()) / total if total else 0.0,
            float(routed.max()) / mean if mean else 1.0,
        )


@dataclass
class Grouped:
    """Kept choices sorted by expert: ``tokens[i]`` goes to expert ``experts[i]``."""

    tokens: Tensor
    weights: Tensor
    counts: Tensor


def group_by_expert(experts: Tensor, weights: Tensor, num_experts: int) -> Grouped:
    """Sort the kept ``(token, choice)`` pairs of ``experts [k, s]`` by expert (stable).

    A choice of expert -1 was dropped. One stable sort of all ``k * s`` choices puts the
    dropped ones first, so the kept ones follow in the order a sort of the kept ones alone
    gives; the token of position ``p`` in ``[k, s]`` is ``p % s``.
    """
    s = experts.shape[1]
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat + 1, minlength=num_experts + 1)
    order = order[int(counts[0]) :]
    return Grouped(order % s, weights.reshape(-1)[order], counts[1:])


def gather_tokens(x: Tensor, g: Grouped) -> Tensor:
    """The rows of ``x [tokens, d]`` in ``g``'s order (a token once per kept choice)."""
    return x.index_select(0, g.tokens)


def combine(out: Tensor, g: Grouped, num_tokens: int, dtype: torch.dtype) -> Tensor:
    """Sum each token's expert outputs weighted by the gate (fp32), cast to ``dtype``."""
    acc = out.new_zeros((num_tokens, out.shape[-1]), dtype=torch.float32)
    acc.index_add_(0, g.tokens, out.float() * g.weights.unsqueeze(-1))
    return acc.to(dtype)


def _blocks_in_order(x: Tensor, sizes: list[list[int]], by_row: bool) -> Tensor:
    """Rows of ``x`` in blocks ``sizes[a][b]``, stored ``a``-major when ``by_row`` (else
    ``b``-major), copied out in the other order. One copy, no index tensor."""
    outer, inner = len(sizes), len(sizes[0])
    if outer == 1 or inner == 1:
        return x
    if by_row:  # stored (a, b), wanted (b, a)
        blocks = x.split([n for row in sizes for n in row])
        return torch.cat([blocks[a * inner + b] for b in range(inner) for a in range(outer)])
    blocks = x.split([sizes[a][b] for b in range(inner) for a in range(outer)])
    return torch.cat([blocks[b * outer + a] for a in range(outer) for b in range(inner)])


def run_local_experts(experts: nn.Module, rows: Tensor, counts: list[int]) -> Tensor:
    """Each local expert on its block of ``rows`` (``counts[i]`` rows for expert ``i``):
    ``experts.run_grouped(rows, counts)``."""
    out: Tensor = experts.run_grouped(rows, counts)  # type: ignore[operator]
    return out


def exchange_and_run(
    experts: nn.Module,
    rows: Tensor,
    counts: Tensor,
    ep_size: int,
    group: comm.Group,
    tp_group: comm.Group = None,
) -> Tensor:
    """Send ``rows`` (sorted by global expert, ``counts [experts]``) to the expert owners,
    run the local experts, and bring the results back in the same row order.

    ``tp_group``: the experts are split over this tensor-parallel group (expert TP) and
    ``rows`` are the same on its ranks. With ``ep_size`` > 1 each TP rank then sends only
    its share of the rows (``slipstream.moe.tp_rows.tp_pieces``), and the received
    rows are all-gathered over TP before the split experts run on them; the way back is the
    reverse. The all-to-alls carry ``1/tp`` of the rows.
    """
    local = counts.numel() // ep_size
    if ep_size == 1:
        return run_local_experts(experts, rows, counts.tolist())
    if tp_group is not None and comm.get_world_size(tp_group) > 1:
        return exchange_split_experts(experts, rows, counts, ep_size, group, tp_group)
    sent = counts.reshape(ep_size, local)
    got = torch.empty_like(sent)
    comm.all_to_all_single(got, sent.contiguous(), group=group, label="moe_counts")
    sizes: list[list[int]] = got.tolist()  # [source rank][local expert]
    send, recv = sent.sum(1).tolist(), [sum(row) for row in sizes]
    received = all_to_all_uneven(rows, send, recv, group)
    # (source rank, local expert) order to (local expert, source rank) and back.
    per_expert = [sum(row[e] for row in sizes) for e in range(local)]
    out = run_local_experts(experts, _blocks_in_order(received, sizes, True), per_expert)
    return all_to_all_uneven(_blocks_in_order(out, sizes, False), recv, send, group)


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
    Rank ``r`` sends its ``tp_pieces`` share through the expert-parallel all-to-all; the
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
    sent = tp_piece_counts(counts, tp_size, tp_rank).reshape(ep_size, local)
    got = torch.empty_like(sent)
    comm.all_to_all_single(got, sent.contiguous(), group=group, label="moe_counts")
    every = got.new_empty((tp_size * ep_size * local,))
    comm.all_gather_into_tensor(every, got.reshape(-1), group=tp_group, label="moe_tp_counts")
    sizes: list[list[int]] = every.reshape(tp_size * ep_size, local).tolist()
    send = sent.sum(1).tolist()
    recv = [sum(row) for row in sizes[tp_rank * ep_size : (tp_rank + 1) * ep_size]]
    piece = DropRows.apply(rows, pieces, tp_group)
    received = all_to_all_uneven(piece, send, recv, group)
    # Where each TP rank's received rows sit in the gathered rows: one block per TP rank.
    totals = [
        sum(sum(row) for row in sizes[r * ep_size : (r + 1) * ep_size]) for r in range(tp_size)
    ]
    starts = [sum(totals[:r]) for r in range(tp_size)]
    blocks = [
        torch.arange(starts[r], starts[r] + totals[r], device=rows.device) for r in range(tp_size)
    ]
    gathered = GatherRows.apply(received, blocks, tp_group)
    # (TP rank, source rank, local expert) order to (local expert, ...) and back.
    per_expert = [sum(row[e] for row in sizes) for e in range(local)]
    out = run_local_experts(experts, _blocks_in_order(gathered, sizes, True), per_expert)
    out = DropRows.apply(_blocks_in_order(out, sizes, False), blocks, tp_group)
    back = all_to_all_uneven(out, recv, send, group)
    full: Tensor = GatherRows.apply(back, pieces, tp_group)
    return full


class MOELayer(nn.Module):
    """Gate + experts + dispatch (DeepSpeed's ``MOELayer``): ``forward(x)`` returns the output
    and leaves ``l_aux``, ``exp_counts`` and ``stats`` on the layer.

    Args:
        gate: a :class:`~slipstream.moe.gating.TopKGate`.
        experts: the local :class:`~slipstream.moe.experts.Experts`.
        ep_group_name: name of the expert-parallel group (``"ep_size_<n>"``).
        ep_size: expert-parallel ranks the experts are spread over.
        num_local_experts: experts on this rank.
        use_tutel: accepted for DeepSpeed compatibility; slipstream's dispatch is used.
    """

    def __init__(
        self,
        gate: nn.Module,
        experts: nn.Module,
        ep_group_name: str,
        ep_size: int,
        num_local_experts: int,
        use_tutel: bool = False,
    ) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.ep_group: comm.Group = None
        self.ep_size = ep_size
        self.ep_group_name = ep_group_name
        self.num_local_experts = num_local_experts
        self.use_tutel = False
        self.wall_clock_breakdown = False
        self.l_aux: Tensor = torch.zeros(())
        self.exp_counts: Tensor = torch.zeros(0, dtype=torch.long)
        self.stats: RoutingStats | None = None
        # Set by ``expert_parallel_`` under tensor parallelism with TP-replicated experts
        # (``slipstream.moe.tensor_parallel.TPTokenSplit``): how the rows reach the experts.
        self.exchange: Callable[..., Tensor] = exchange_and_run
        # Set by ``expert_parallel_`` for expert tensor parallelism: the TP group the experts
        # are split over (``exchange_and_run`` then sends each row once per TP group).
        self.expert_tp_group: comm.Group = None

    def _set_ep_group(self, ep_group: comm.Group) -> None:
        self.ep_group = ep_group
        self.gate._set_ep_group(ep_group)  # type: ignore[operator]

    def _check_group(self) -> None:
        if self.ep_size > 1 and comm.get_world_size(self.ep_group) != self.ep_size:
            raise RuntimeError(
                f"this MoE layer has ep_size={self.ep_size} but its expert-parallel group has "
                f"{comm.get_world_size(self.ep_group)} ranks: apply "
                "slipstream.moe.expert_parallel_(model, mesh) (slipstream.initialize does) "
                "before the first forward"
            )

    def forward(self, *input: Tensor, **kwargs: Any) -> Tensor:
        self._check_group()
        x = input[0]
        used_token = input[1] if len(input) > 1 else None
        flat = x.reshape(-1, x.shape[-1])
        routes: Routes = self.gate.routes(flat, used_token)  # type: ignore[operator]
        g = group_by_expert(routes.experts, routes.weights, routes.num_experts)
        rows = gather_tokens(flat, g)
        if self.expert_tp_group is not None:
            out = self.exchange(
                self.experts, rows, g.counts, self.ep_size, self.ep_group, self.expert_tp_group
            )
        else:
            out = self.exchange(self.experts, rows, g.counts, self.ep_size, self.ep_group)
        self.l_aux, self.exp_counts = routes.l_aux, routes.exp_counts
        self.stats = RoutingStats.of(routes.exp_counts, g.counts)
        return combine(out, g, flat.shape[0], x.dtype).reshape(x.shape)
