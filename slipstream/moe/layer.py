"""``MoE``: DeepSpeed-MoE's layer (``deepspeed.moe.layer.MoE``), with residual MoE (PR-MoE).

Rajbhandari et al., "DeepSpeed-MoE" (arXiv:2201.05596): section 4.1 (Residual-MoE: a dense
MLP beside the experts, mixed by a learned two-way coefficient). The layer's arguments, its
``(output, l_aux, exp_counts)`` result and its parameter names (``deepspeed_moe.gate.wg``,
``deepspeed_moe.experts.deepspeed_experts.<i>``, ``mlp``, ``coefficient``) are DeepSpeed's, so
models and their state dicts move between the two unchanged.
"""

from __future__ import annotations

import logging

import torch.nn.functional as F
from torch import Tensor, nn

from slipstream.distributed import comm
from slipstream.distributed.expert import expert_groups
from slipstream.moe.dispatch import MOELayer, RoutingStats
from slipstream.moe.experts import Experts
from slipstream.moe.gating import NOISY_GATE_POLICIES, TopKGate

__all__ = ["MoE"]

logger = logging.getLogger(__name__)


class MoE(nn.Module):
    """A mixture-of-experts layer: ``num_experts`` copies of ``expert`` behind a top-k gate.

    Args:
        hidden_size: model dimension (the layer's input and output size).
        expert: the expert module (``[n, hidden] -> [n, hidden]``); deep-copied per expert.
        num_experts: experts in the layer, over all expert-parallel ranks.
        ep_size: ranks the experts are spread over (``num_experts % ep_size == 0``).
        k: experts per token (1: Switch, 2: GShard, larger: top-k).
        capacity_factor: training capacity, as a multiple of an even share of the tokens.
        eval_capacity_factor: the same in eval mode.
        min_capacity: the least capacity per expert.
        use_residual: Residual MoE: add a dense copy of ``expert`` mixed in by a coefficient.
        noisy_gate_policy: None, ``'Jitter'`` (input noise) or ``'RSample'`` (Gumbel logits).
        drop_tokens: drop tokens past the capacity (False: capacity is the busiest expert's load).
        use_rts: random token selection when an expert overflows (top-1).
        use_tutel: accepted and ignored (logged): slipstream's grouped dispatch is used.
        enable_expert_tensor_parallelism: under tensor parallelism, split each expert's MLP
            column/row-wise over the TP group like the dense MLP (the automatic TP plan does;
            a model's own plan must name the expert layers); False: the experts are
            replicated over the TP group and each TP rank computes its share of the tokens
            (``slipstream.moe.tensor_parallel``). Without tensor parallelism it has no effect.
        top2_2nd_expert_sampling: Gumbel-sample the second expert (top-2).

    Raises:
        ValueError: ``num_experts`` not divisible by ``ep_size``, or an unknown noise policy.
    """

    def __init__(
        self,
        hidden_size: int,
        expert: nn.Module,
        num_experts: int = 1,
        ep_size: int = 1,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        use_residual: bool = False,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        use_tutel: bool = False,
        enable_expert_tensor_parallelism: bool = False,
        top2_2nd_expert_sampling: bool = True,
    ) -> None:
        super().__init__()
        if ep_size < 1 or num_experts % ep_size:
            raise ValueError(
                f"MoE num_experts={num_experts} must be divisible by ep_size={ep_size}: "
                "choose an ep_size that divides the number of experts"
            )
        if noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ValueError(
                f"MoE noisy_gate_policy={noisy_gate_policy!r} is not one of None, 'None', "
                "'Jitter', 'RSample'"
            )
        if use_tutel:
            logger.info("MoE use_tutel=True ignored: slipstream uses its own grouped dispatch")
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        self.ep_size = ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        self.k = k
        logger.debug(
            "MoE layer: %d experts, %d local, ep_size %d",
            num_experts,
            self.num_local_experts,
            ep_size,
        )
        gate = TopKGate(
            hidden_size,
            num_experts,
            k,
            capacity_factor,
            eval_capacity_factor,
            min_capacity,
            noisy_gate_policy,
            drop_tokens,
            use_rts,
            None,
            top2_2nd_expert_sampling,
        )
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        self.deepspeed_moe = MOELayer(
            gate, experts, self.expert_group_name, ep_size, self.num_local_experts
        )
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)

    @property
    def expert_module(self) -> nn.Module:
        """The module holding this rank's experts."""
        return self.deepspeed_moe.experts

    @property
    def stats(self) -> RoutingStats | None:
        """Routing statistics of the last forward (None before the first)."""
        return self.deepspeed_moe.stats

    def set_ep_group(self, ep_group: comm.Group) -> None:
        """Give the layer its expert-parallel group (``expert_parallel_`` does this)."""
        self.deepspeed_moe._set_ep_group(ep_group)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """DeepSpeed's hook: build this layer's expert-parallel group over the whole world."""
        groups = expert_groups(None, self.ep_size, use_data_before_expert_parallel_)
        self.set_ep_group(groups.ep_group)

    def forward(
        self, hidden_states: Tensor, used_token: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``(output, l_aux, exp_counts)`` for ``hidden_states [..., hidden_size]``."""
        if used_token is None:
            output = self.deepspeed_moe(hidden_states)
        else:
            output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            dense = self.mlp(hidden_states)
            if isinstance(dense, tuple):
                dense = dense[0]
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + dense * coef[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts
