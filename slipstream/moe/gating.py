"""Capacity-based token-choice gating: top-1 (Switch), top-2 (GShard) and top-k.

The routing decisions follow DeepSpeed-MoE's gate (DeepSpeed 0.19.8 ``sharded_moe``) on purpose,
so a model trained there routes the same tokens here given the same logits and random state:

- capacity per expert is ``max(ceil(tokens / experts * capacity_factor * f), min_capacity)``
  with ``f = 1`` for top-1 and ``f = k`` for top-k (GShard, arXiv:2006.16668 section 2.2);
- top-1 keeps, per expert, ``capacity`` of its tokens: a random subset when random token
  selection is on (RTS, DeepSpeed-MoE arXiv:2201.05596 section 5), else the first ones;
- top-2 keeps tokens in order of arrival, first choices before second choices, and with
  ``top2_2nd_expert_sampling`` picks the second expert after Gumbel noise on the logits;
- top-k (k > 2) keeps, per expert, the tokens with the largest gate values;
- ``drop_tokens=False`` raises the capacity to the busiest expert's load (the maximum over
  the expert-parallel group, so every rank sends equal buffers);
- the auxiliary loss is Switch's ``E * sum_e(mean gate_e * fraction routed_e)`` (top-1), scaled
  by ``E / k`` for k >= 2 as DeepSpeed does.

Random numbers are drawn in DeepSpeed's order and shapes (``torch.distributions`` uniform and
Gumbel samplers), so equal seeds give equal noise.

The result is a :class:`Routes` record: one ``(expert, slot, weight)`` triple per token and
choice, with ``expert = -1`` for a dropped choice. The dense ``combine_weights`` /
``dispatch_mask`` tensors DeepSpeed's functions return are built from it only on request
(:meth:`Routes.dense`); the layer never materialises the ``[tokens, experts, capacity]`` tensor.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from slipstream.distributed import comm

__all__ = [
    "NOISY_GATE_POLICIES",
    "Routes",
    "TopKGate",
    "capacity_for",
    "gumbel_rsample",
    "multiplicative_jitter",
    "top1_routes",
    "top2_routes",
    "topk_routes",
]

logger = logging.getLogger(__name__)

NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")


@dataclass
class Routes:
    """Where each token goes: ``k`` choices per token, each an expert, a slot and a weight.

    Attributes:
        experts: ``[k, tokens]`` int64 expert id of each choice; -1 where it was dropped.
        slots: ``[k, tokens]`` int64 position inside the expert's capacity buffer (0 if dropped).
        weights: ``[k, tokens]`` fp32 combine weight (0 for a dropped choice).
        capacity_spec: slots per expert, or (dropless) a function that agrees them over the
            expert-parallel group when :attr:`capacity` is first read: only DeepSpeed's dense
            form needs them, so slipstream's own dispatch never pays that all-reduce.
        num_experts: experts in the layer (all ranks together).
        l_aux: the auxiliary load-balancing loss (a scalar with gradient to the gate).
        exp_counts: ``[experts]`` tokens routed to each expert before capacity was applied.
    """

    experts: Tensor
    slots: Tensor
    weights: Tensor
    capacity_spec: int | Callable[[], int]
    num_experts: int
    l_aux: Tensor
    exp_counts: Tensor

    @property
    def capacity(self) -> int:
        """Slots per expert (a collective over the expert-parallel group on the first read
        in dropless mode: every rank of the group must read it)."""
        if callable(self.capacity_spec):
            self.capacity_spec = self.capacity_spec()
        return self.capacity_spec

    def dense(self) -> tuple[Tensor, Tensor]:
        """``(combine_weights [s, e, c], dispatch_mask [s, e, c])`` as DeepSpeed returns them."""
        k, s = self.experts.shape
        out = self.weights.new_zeros(s, self.num_experts, self.capacity)
        kept = self.experts >= 0
        token = torch.arange(s, device=self.experts.device).expand(k, s)
        out.index_put_(
            (token[kept], self.experts[kept], self.slots[kept]), self.weights[kept], accumulate=True
        )
        return out, out.bool()

    def sparse(self) -> tuple[Tensor, int, Tensor, Tensor, Tensor]:
        """``(capacity, num_experts, indices [k, s], locations [k, s], gates [k, s])``: the
        per-route form DeepSpeed's gating returns with ``sparse_routes=True`` (int32 expert
        ids with -1 for a dropped route, int32 slots, fp32 combine weights; capacity an int64
        scalar tensor, as DeepSpeed computes it)."""
        capacity = torch.tensor(self.capacity, dtype=torch.int64, device=self.experts.device)
        return (
            capacity,
            self.num_experts,
            self.experts.to(torch.int32),
            self.slots.to(torch.int32),
            self.weights,
        )


_SAMPLERS: dict[tuple[str, torch.device, float], Callable[[torch.Size], Tensor]] = {}


def _sampler(kind: str, device: torch.device, epsilon: float = 0.0) -> Callable[..., Tensor]:
    key = (kind, device, epsilon)
    if key not in _SAMPLERS:
        lo, hi = torch.tensor(0.0, device=device), torch.tensor(1.0, device=device)
        if kind == "gumbel":
            _SAMPLERS[key] = torch.distributions.Gumbel(lo, hi).rsample
        elif kind == "jitter":
            dist = torch.distributions.Uniform(lo + (1.0 - epsilon), lo + (1.0 + epsilon))
            _SAMPLERS[key] = dist.rsample
        else:
            _SAMPLERS[key] = torch.distributions.Uniform(lo, hi).rsample
    return _SAMPLERS[key]


def gumbel_rsample(shape: tuple[int, ...] | torch.Size, device: torch.device) -> Tensor:
    """Standard Gumbel noise of ``shape`` (the Gumbel-max trick of RSample and top-2 sampling)."""
    return _sampler("gumbel", device)(torch.Size(shape))


def multiplicative_jitter(x: Tensor, device: torch.device, epsilon: float = 1e-2) -> Tensor:
    """``x`` times uniform noise in ``[1 - epsilon, 1 + epsilon]`` (Switch's input jitter)."""
    if epsilon == 0:
        return x
    return x * _sampler("jitter", device, epsilon)(x.shape)


def capacity_for(num_tokens: int, num_experts: int, factor: float, min_capacity: int) -> int:
    """Slots per expert: ``max(ceil(num_tokens / num_experts * factor), min_capacity)``."""
    return max(math.ceil(num_tokens / num_experts * factor), min_capacity)


def _dropless_capacity(exp_counts: Tensor, ep_group: comm.Group, limit: int | None = None) -> int:
    """The busiest expert's load, agreed over the expert-parallel group (equal buffers),
    at most ``limit``."""
    top = exp_counts.max().reshape(1).clone()
    if ep_group is not None and comm.get_world_size(ep_group) > 1:
        comm.all_reduce(top, op=comm.ReduceOp.MAX, group=ep_group, label="moe_capacity")
    return int(top.item()) if limit is None else min(int(top.item()), limit)


def top1_routes(
    logits: Tensor,
    capacity_factor: float,
    min_capacity: int,
    used_token: Tensor | None = None,
    noisy_gate_policy: str | None = None,
    drop_tokens: bool = True,
    use_rts: bool = True,
    ep_group: comm.Group = None,
) -> Routes:
    """Switch-style top-1 routing of ``logits [tokens, experts]`` (fp32)."""
    noisy = None
    if noisy_gate_policy == "RSample":
        noisy = logits + gumbel_rsample(logits.shape, logits.device)
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    capacity = capacity_for(num_tokens, num_experts, capacity_factor, min_capacity)
    choice = torch.argmax(noisy if noisy is not None else gates, dim=1)
    mask = F.one_hot(choice, num_classes=num_experts)
    if used_token is not None:
        mask = mask * used_token.reshape(-1, 1).to(mask.dtype)
    exp_counts = mask.sum(dim=0).detach()
    spec: int | Callable[[], int] = capacity
    if not drop_tokens:
        # Keeping the local busiest expert's load keeps every choice, as the group's would.
        capacity = min(int(exp_counts.max()), num_tokens)
        spec = partial(_dropless_capacity, exp_counts, ep_group, num_tokens)
    l_aux = torch.sum(gates.mean(dim=0) * mask.float().mean(dim=0)) * num_experts
    if num_tokens < min_capacity:
        raise ValueError(
            f"the MoE layer got {num_tokens} tokens, fewer than min_capacity={min_capacity}: "
            "set min_capacity to 0 or feed larger batches"
        )
    score = mask * _sampler("uniform", logits.device)(mask.shape) if use_rts else mask
    keep = torch.topk(score, k=min(capacity, num_tokens), dim=0)[1]
    mask = mask * torch.zeros_like(mask).scatter_(0, keep, 1)
    kept = mask.sum(dim=1) > 0
    slots = ((torch.cumsum(mask, dim=0) - 1) * mask).sum(dim=1)
    weights = (gates * mask).sum(dim=1)
    experts = torch.where(kept, choice, torch.full_like(choice, -1))
    return Routes(
        experts.unsqueeze(0),
        slots.unsqueeze(0),
        weights.unsqueeze(0),
        spec,
        num_experts,
        l_aux,
        exp_counts,
    )


def top2_routes(
    logits: Tensor,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    ep_group: comm.Group = None,
    top2_2nd_expert_sampling: bool = True,
) -> Routes:
    """GShard-style top-2 routing of ``logits [tokens, experts]`` (fp32)."""
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    first = torch.argmax(gates, dim=1)
    mask1 = F.one_hot(first, num_classes=num_experts)
    if top2_2nd_expert_sampling:
        logits = logits + gumbel_rsample(logits.shape, logits.device)
    second = torch.argmax(logits.masked_fill(mask1.bool(), float("-inf")), dim=1)
    mask2 = F.one_hot(second, num_classes=num_experts)
    loc1 = torch.cumsum(mask1, dim=0) - 1
    # Second choices queue behind every first choice of their expert.
    loc2 = torch.cumsum(mask2, dim=0) - 1 + mask1.sum(dim=0, keepdim=True)
    l_aux = torch.mean(gates.mean(dim=0) * mask1.float().mean(dim=0)) * num_experts * num_experts
    exp_counts = (mask1 + mask2).sum(dim=0).detach()
    capacity: int | Callable[[], int]
    if drop_tokens:
        capacity = capacity_for(num_tokens, num_experts, capacity_factor * 2, min_capacity)
        mask1 = mask1 * (loc1 < capacity)
        mask2 = mask2 * (loc2 < capacity)
    else:
        capacity = partial(_dropless_capacity, exp_counts, ep_group)
    g1 = (gates * mask1).sum(dim=1)
    g2 = (gates * mask2).sum(dim=1)
    denom = torch.clamp(g1 + g2, min=torch.finfo(gates.dtype).eps)
    experts = torch.stack(
        [
            torch.where(mask1.any(dim=1), first, torch.full_like(first, -1)),
            torch.where(mask2.any(dim=1), second, torch.full_like(second, -1)),
        ]
    )
    slots = torch.stack([(loc1 * mask1).sum(dim=1), (loc2 * mask2).sum(dim=1)])
    return Routes(
        experts,
        slots,
        torch.stack([g1 / denom, g2 / denom]),
        capacity,
        num_experts,
        l_aux,
        exp_counts,
    )


def topk_routes(
    logits: Tensor,
    k: int,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    ep_group: comm.Group = None,
) -> Routes:
    """Top-k routing (k > 2): per expert, the tokens with the largest gate values are kept."""
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    top_gate, top_idx = torch.topk(gates, k=k, dim=1)
    mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, top_idx, True)
    exp_counts = mask.sum(dim=0).detach()
    l_aux = torch.mean(gates.mean(dim=0) * mask.float().mean(dim=0)) * num_experts**2 / k
    capacity: int | Callable[[], int]
    if drop_tokens:
        capacity = capacity_for(num_tokens, num_experts, capacity_factor * k, min_capacity)
        by_gate = torch.zeros_like(gates).scatter(1, top_idx, top_gate)
        keep = torch.topk(by_gate, k=min(capacity, num_tokens), dim=0, sorted=False)[1]
        mask &= torch.zeros_like(mask).scatter_(0, keep, True)
    else:
        capacity = partial(_dropless_capacity, exp_counts, ep_group)
    locations = torch.cumsum(mask, dim=0) - 1
    masked = gates * mask
    masked = masked / torch.clamp(
        masked.sum(dim=-1, keepdim=True), min=torch.finfo(gates.dtype).eps
    )
    kept = mask.gather(1, top_idx)
    experts = torch.where(kept, top_idx, torch.full_like(top_idx, -1))
    slots = locations.gather(1, top_idx) * kept
    weights = masked.gather(1, top_idx)
    return Routes(
        experts.t().contiguous(),
        slots.t().contiguous(),
        weights.t().contiguous(),
        capacity,
        num_experts,
        l_aux,
        exp_counts,
    )


class TopKGate(nn.Module):
    """The router: a bias-free linear ``wg`` from the model dimension to one logit per expert.

    Logits are computed in fp32 whatever the input dtype. ``capacity_factor`` applies in
    training, ``eval_capacity_factor`` in eval; noise (``Jitter`` on the input, ``RSample`` on
    the logits) only in training.
    """

    wg: nn.Linear

    def __init__(
        self,
        model_dim: int,
        num_experts: int,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 8,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        ep_group: comm.Group = None,
        top2_2nd_expert_sampling: bool = True,
    ) -> None:
        super().__init__()
        if k < 1 or k > num_experts:
            raise ValueError(f"TopKGate k={k} must be between 1 and num_experts={num_experts}")
        if noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ValueError(
                f"noisy_gate_policy={noisy_gate_policy!r} is not one of 'None', 'Jitter', 'RSample'"
            )
        if noisy_gate_policy is not None and noisy_gate_policy != "None" and k != 1:
            logger.info("noisy_gate_policy=%s applies to top-1 gating only", noisy_gate_policy)
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        self.ep_group = ep_group
        self.k = k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = noisy_gate_policy
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling
        self.wall_clock_breakdown = False
        self.gate_time = 0.0

    def _set_ep_group(self, ep_group: comm.Group) -> None:
        self.ep_group = ep_group

    def routes(self, input: Tensor, used_token: Tensor | None = None) -> Routes:
        """Route ``input [tokens, model_dim]``."""
        x = input.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            x = multiplicative_jitter(x, device=input.device)
        logits = F.linear(x, self.wg.weight.float())
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            policy = self.noisy_gate_policy if self.training else None
            return top1_routes(
                logits,
                factor,
                self.min_capacity,
                used_token,
                policy,
                self.drop_tokens,
                self.use_rts,
                self.ep_group,
            )
        if self.k == 2:
            return top2_routes(
                logits,
                factor,
                self.min_capacity,
                self.drop_tokens,
                self.ep_group,
                self.top2_2nd_expert_sampling,
            )
        return topk_routes(
            logits, self.k, factor, self.min_capacity, self.drop_tokens, self.ep_group
        )

    def forward(
        self,
        input: Tensor,
        used_token: Tensor | None = None,
        sparse_routes: bool = False,
        use_tutel: bool = False,
    ) -> tuple[Tensor | int, ...]:
        """DeepSpeed's gate result: ``(l_aux, combine_weights, dispatch_mask, exp_counts)``, or
        with ``sparse_routes`` ``(l_aux, capacity, num_experts, indices, locations, gates,
        exp_counts)`` (:meth:`Routes.sparse`). ``use_tutel`` changes nothing here (DeepSpeed
        uses it for a faster cumulative sum of the same value)."""
        r = self.routes(input, used_token)
        if sparse_routes:
            return r.l_aux, *r.sparse(), r.exp_counts
        combine, dispatch = r.dense()
        return r.l_aux, combine, dispatch, r.exp_counts
