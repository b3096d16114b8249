"""Mixture of experts (``deepspeed.moe``): DeepSpeed-MoE's layer and gate, grouped dispatch,
expert parallelism from the device mesh. See docs/moe.md."""

from slipstream.moe.dispatch import MOELayer, RoutingStats
from slipstream.moe.dropless import DroplessMoE, GroupedExperts, RouterConfig, TokenChoiceRouter
from slipstream.moe.experts import Experts
from slipstream.moe.gating import Routes, TopKGate
from slipstream.moe.layer import MoE
from slipstream.moe.plan import (
    agree_expert_groups,
    clip_grad_norm_,
    expert_parallel_,
    reduce_gradients_,
    routing_stats,
)
from slipstream.moe.utils import has_moe_layers, is_moe_param, moe_layers

__all__ = [
    "DroplessMoE",
    "Experts",
    "GroupedExperts",
    "MOELayer",
    "MoE",
    "RouterConfig",
    "Routes",
    "RoutingStats",
    "TokenChoiceRouter",
    "TopKGate",
    "agree_expert_groups",
    "clip_grad_norm_",
    "expert_parallel_",
    "has_moe_layers",
    "is_moe_param",
    "moe_layers",
    "reduce_gradients_",
    "routing_stats",
]
