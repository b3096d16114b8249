"""``deepspeed.moe.sharded_moe``: the gate, the MoE layer and the gating functions under
DeepSpeed's names. The implementations live in :mod:`slipstream.moe.gating` and
:mod:`slipstream.moe.dispatch`; the functions here return DeepSpeed's dense form
``(l_aux, combine_weights [s, e, c], dispatch_mask [s, e, c], exp_counts)``, or with
``sparse_routes=True`` DeepSpeed's per-route form ``(l_aux, capacity, num_experts, indices
[k, s], locations [k, s], gates [k, s], exp_counts)``.
"""

from __future__ import annotations

from torch import Tensor

from slipstream.distributed import comm
from slipstream.moe.dispatch import MOELayer
from slipstream.moe.gating import (
    Routes,
    TopKGate,
    gumbel_rsample,
    multiplicative_jitter,
    top1_routes,
    top2_routes,
    topk_routes,
)

__all__ = [
    "MOELayer",
    "TopKGate",
    "gumbel_rsample",
    "multiplicative_jitter",
    "top1gating",
    "top2gating",
    "topkgating",
]


def top1gating(
    logits: Tensor,
    capacity_factor: float,
    min_capacity: int,
    used_token: Tensor | None = None,
    noisy_gate_policy: str | None = None,
    drop_tokens: bool = True,
    use_rts: bool = True,
    ep_group: comm.Group = None,
    sparse_routes: bool = False,
    use_tutel: bool = False,
) -> tuple[Tensor | int, ...]:
    """Top-1 gating; see :func:`slipstream.moe.gating.top1_routes`."""
    r = top1_routes(
        logits,
        capacity_factor,
        min_capacity,
        used_token,
        noisy_gate_policy,
        drop_tokens,
        use_rts,
        ep_group,
    )
    return _deepspeed_form(r, sparse_routes)


def top2gating(
    logits: Tensor,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    ep_group: comm.Group = None,
    top2_2nd_expert_sampling: bool = True,
    sparse_routes: bool = False,
) -> tuple[Tensor | int, ...]:
    """Top-2 gating; see :func:`slipstream.moe.gating.top2_routes`."""
    r = top2_routes(
        logits, capacity_factor, min_capacity, drop_tokens, ep_group, top2_2nd_expert_sampling
    )
    return _deepspeed_form(r, sparse_routes)


def topkgating(
    logits: Tensor,
    k: int,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    ep_group: comm.Group = None,
    drop_policy: str = "probs",
    sparse_routes: bool = False,
) -> tuple[Tensor | int, ...]:
    """Top-k gating (tokens with the largest gates kept); see
    :func:`slipstream.moe.gating.topk_routes`.

    Raises:
        ValueError: a ``drop_policy`` other than ``"probs"``.
    """
    if drop_policy != "probs":
        raise ValueError(
            f"topkgating drop_policy={drop_policy!r} is not supported: only 'probs' (keep the "
            "tokens with the largest gate values) is implemented"
        )
    r = topk_routes(logits, k, capacity_factor, min_capacity, drop_tokens, ep_group)
    return _deepspeed_form(r, sparse_routes)


def _deepspeed_form(r: Routes, sparse_routes: bool) -> tuple[Tensor | int, ...]:
    """``(l_aux, combine_weights, dispatch_mask, exp_counts)``, or DeepSpeed's per-route
    form with ``sparse_routes`` (:meth:`Routes.sparse`)."""
    if sparse_routes:
        return r.l_aux, *r.sparse(), r.exp_counts
    return r.l_aux, *r.dense(), r.exp_counts
