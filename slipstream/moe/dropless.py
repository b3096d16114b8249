"""Dropless token-choice MoE with grouped expert GEMMs (MegaBlocks / torchtitan style).

- **Router** (:class:`TokenChoiceRouter`): each token picks its top-k experts by softmax or
  sigmoid score; no capacity, nothing is dropped. Optional: normalising the k weights
  (``route_norm``), scaling them (``route_scale``), the Switch auxiliary loss
  (Fedus et al. 2021, eq. 4), the router z-loss (Zoph et al., ST-MoE 2022, eq. 5:
  ``mean(logsumexp(logits)^2)``), and auxiliary-loss-free load balancing (DeepSeek-V3,
  arXiv:2412.19437 section 2.1.2): a per-expert bias added to the scores for the choice only,
  nudged by ``bias_update_rate`` towards the mean load by :meth:`DroplessMoE.update_bias_`.
- **Experts** (:class:`GroupedExperts`): all local experts' weights stacked
  (``[experts, in, out]``); the tokens, sorted by expert, go through one grouped GEMM per
  projection (``torch._grouped_mm`` where the build and the shapes allow it, else one padded
  batched GEMM), so the cost does not grow with a Python loop over experts.
- **Dispatch** is :mod:`slipstream.moe.dispatch`'s: sort by expert, exchange counts, uneven
  all-to-all across the expert-parallel group, combine in fp32.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from slipstream.distributed import comm
from slipstream.moe.dispatch import (
    RoutingStats,
    combine,
    exchange_and_run,
    gather_tokens,
    group_by_expert,
)
from slipstream.moe.experts import mark_expert_params
from slipstream.moe.grouped import grouped_mm

__all__ = ["DroplessMoE", "GroupedExperts", "RouterConfig", "TokenChoiceRouter"]


class GroupedExperts(nn.Module):
    """``num_local_experts`` MLPs with stacked weights: ``w2(act(x @ w1) [* (x @ w3)])``.

    Args:
        hidden_size: model dimension.
        ffn_hidden_size: each expert's inner dimension.
        num_local_experts: experts held by this rank.
        activation: ``"gelu"``, ``"relu"`` or ``"swiglu"`` (adds the gate projection ``w3``).
        expert_group_name: the expert-parallel group name the parameters are marked with.
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_local_experts: int,
        activation: Literal["gelu", "relu", "swiglu"] = "gelu",
        expert_group_name: str | None = None,
    ) -> None:
        super().__init__()
        if activation not in ("gelu", "relu", "swiglu"):
            raise ValueError(f"GroupedExperts activation={activation!r}: use gelu, relu or swiglu")
        self.activation = activation
        self.num_local_experts = num_local_experts
        e, d, h = num_local_experts, hidden_size, ffn_hidden_size
        self.w1 = nn.Parameter(torch.empty(e, d, h))
        self.w2 = nn.Parameter(torch.empty(e, h, d))
        self.w3 = nn.Parameter(torch.empty(e, d, h)) if activation == "swiglu" else None
        self.reset_parameters()
        mark_expert_params(self, expert_group_name)

    def reset_parameters(self) -> None:
        for w in (self.w1, self.w2, self.w3):
            if w is not None:
                nn.init.normal_(w, std=1.0 / math.sqrt(w.shape[1]))

    def run_grouped(self, rows: Tensor, counts: list[int]) -> Tensor:
        """Expert ``i`` on ``counts[i]`` consecutive rows of ``rows [n, hidden]``."""
        c = torch.tensor(counts, device=rows.device, dtype=torch.long)
        h = grouped_mm(rows, self.w1, c)
        if self.w3 is not None:
            h = F.silu(h) * grouped_mm(rows, self.w3, c)
        else:
            h = F.gelu(h) if self.activation == "gelu" else F.relu(h)
        return grouped_mm(h, self.w2, c)


@dataclass(frozen=True)
class RouterConfig:
    """How a dropless router scores and balances.

    Attributes:
        k: experts per token.
        score_func: ``"softmax"`` over experts or per-expert ``"sigmoid"``.
        route_norm: renormalise each token's k weights to sum to 1.
        route_scale: multiply the weights by this.
        aux_loss_coef: weight of the Switch load-balancing loss in the returned loss.
        z_loss_coef: weight of the router z-loss in the returned loss.
        bias_update_rate: aux-loss-free balancing step (0 disables the expert bias).
    """

    k: int = 2
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    route_norm: bool = True
    route_scale: float = 1.0
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0
    bias_update_rate: float = 0.0

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"RouterConfig.k={self.k} must be >= 1")
        if self.score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"RouterConfig.score_func={self.score_func!r}: softmax or sigmoid")
        if self.bias_update_rate < 0:
            raise ValueError(f"RouterConfig.bias_update_rate={self.bias_update_rate} must be >= 0")


class TokenChoiceRouter(nn.Module):
    """Top-k token choice without capacity; returns ``(experts [k, s], weights [k, s], loss,
    tokens_per_expert)``."""

    expert_bias: Tensor
    load: Tensor

    def __init__(self, hidden_size: int, num_experts: int, cfg: RouterConfig) -> None:
        super().__init__()
        if cfg.k > num_experts:
            raise ValueError(f"RouterConfig.k={cfg.k} exceeds num_experts={num_experts}")
        self.cfg = cfg
        self.num_experts = num_experts
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(num_experts), persistent=True)
        self.register_buffer("load", torch.zeros(num_experts), persistent=False)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        cfg = self.cfg
        logits = F.linear(x.float(), self.gate.weight.float())
        if cfg.score_func == "softmax":
            scores = torch.softmax(logits, dim=-1)
        else:
            scores = torch.sigmoid(logits)
        choose = scores + self.expert_bias if cfg.bias_update_rate > 0 else scores
        idx = torch.topk(choose, cfg.k, dim=-1).indices
        weights = scores.gather(1, idx)
        if cfg.route_norm and cfg.k > 1:
            weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-20)
        weights = weights * cfg.route_scale
        counts = torch.bincount(idx.reshape(-1), minlength=self.num_experts)
        if self.training and cfg.bias_update_rate > 0:
            self.load += counts.to(self.load.dtype)
        loss = logits.new_zeros(())
        if cfg.aux_loss_coef:
            frac = counts.float() / max(idx.numel(), 1)
            probs = (
                scores / scores.sum(dim=-1, keepdim=True) if cfg.score_func == "sigmoid" else scores
            )
            loss = loss + cfg.aux_loss_coef * self.num_experts * (frac * probs.mean(0)).sum()
        if cfg.z_loss_coef:
            loss = loss + cfg.z_loss_coef * torch.logsumexp(logits, dim=-1).square().mean()
        return idx.t().contiguous(), weights.t().contiguous(), loss, counts

    @torch.no_grad()
    def update_bias_(self, group: comm.Group = None) -> None:
        """DeepSeek-V3's update: ``bias += rate * sign(mean load - load)`` from the loads
        since the last call (summed over ``group`` when given), then reset the loads."""
        load = self.load.clone()
        if group is not None and comm.get_world_size(group) > 1:
            comm.all_reduce(load, group=group, label="moe_expert_load")
        self.expert_bias += self.cfg.bias_update_rate * torch.sign(load.mean() - load)
        self.load.zero_()


class DroplessMoE(nn.Module):
    """A dropless MoE feed-forward layer: router + grouped experts + grouped dispatch.

    ``forward(x)`` returns ``(output, loss, tokens_per_expert)`` like :class:`MoE`, where
    ``loss`` is the router's weighted auxiliary + z-loss (add it to the training loss).

    Args:
        hidden_size: model dimension.
        ffn_hidden_size: each expert's inner dimension.
        num_experts: experts over all expert-parallel ranks.
        ep_size: expert-parallel ranks (``num_experts % ep_size == 0``).
        router: scoring and balancing options.
        activation: the experts' activation (``gelu``, ``relu``, ``swiglu``).
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_experts: int,
        ep_size: int = 1,
        router: RouterConfig | None = None,
        activation: Literal["gelu", "relu", "swiglu"] = "gelu",
    ) -> None:
        super().__init__()
        if ep_size < 1 or num_experts % ep_size:
            raise ValueError(
                f"DroplessMoE num_experts={num_experts} must be divisible by ep_size={ep_size}"
            )
        self.num_experts = num_experts
        self.ep_size = ep_size
        self.num_local_experts = num_experts // ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        self.router = TokenChoiceRouter(hidden_size, num_experts, router or RouterConfig())
        self.experts = GroupedExperts(
            hidden_size, ffn_hidden_size, self.num_local_experts, activation, self.expert_group_name
        )
        self.ep_group: comm.Group = None
        self.stats: RoutingStats | None = None
        # Set by ``expert_parallel_`` under tensor parallelism with ``ep_size`` > 1
        # (``slipstream.moe.tensor_parallel.TPTokenSplit``): how the rows reach the experts.
        self.exchange: Callable[..., Tensor] = exchange_and_run

    def set_ep_group(self, ep_group: comm.Group) -> None:
        """Give the layer its expert-parallel group (``expert_parallel_`` does this)."""
        self.ep_group = ep_group

    @property
    def expert_module(self) -> nn.Module:
        """The module holding this rank's experts."""
        return self.experts

    def update_bias_(self, group: comm.Group = None) -> None:
        """Apply the aux-loss-free balancing update (after an optimizer step)."""
        self.router.update_bias_(group)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if self.ep_size > 1 and comm.get_world_size(self.ep_group) != self.ep_size:
            raise RuntimeError(
                f"this DroplessMoE has ep_size={self.ep_size} but no expert-parallel group of "
                "that size: apply slipstream.moe.expert_parallel_(model, mesh) first"
            )
        flat = x.reshape(-1, x.shape[-1])
        experts, weights, loss, counts = self.router(flat)
        g = group_by_expert(experts, weights, self.num_experts)
        out = self.exchange(
            self.experts, gather_tokens(flat, g), g.counts, self.ep_size, self.ep_group
        )
        self.stats = RoutingStats.of(counts, g.counts)
        return combine(out, g, flat.shape[0], x.dtype).reshape(x.shape), loss, counts
