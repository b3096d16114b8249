"""The reference GPT's mixture-of-experts option: some blocks' SwiGLU MLP becomes an MoE layer.

``GPTConfig(moe=GPTMoEConfig(...))`` replaces the MLP of every ``every``-th block (blocks
``every - 1, 2 * every - 1, ...``, as DeepSpeed-MoE's GPT interleaves them) by

- a capacity-based DeepSpeed-MoE layer (:class:`slipstream.moe.MoE`, experts are copies of the
  block's SwiGLU MLP, top-k gate with capacity ``capacity_factor``), or
- with ``capacity_factor=None``, a dropless token-choice layer with grouped SwiGLU experts
  (:class:`slipstream.moe.DroplessMoE`).

The layers' auxiliary losses (load balancing, z-loss) are added to the language-model loss by
:class:`GPT` when labels are given. The model stays single-device; ``ep_size`` > 1 takes
effect once the expert-parallel plan is applied (``slipstream.initialize`` does).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from slipstream.config._errors import ConfigError
from slipstream.moe import DroplessMoE, Experts, GroupedExperts, MoE, RouterConfig, TopKGate
from slipstream.moe.experts import mark_expert_params
from slipstream.moe.grouped import grouped_mm


class _Shape(Protocol):
    """What this module reads of a ``GPTConfig``."""

    hidden_size: int
    intermediate_size: int | None
    num_layers: int

    @property
    def moe(self) -> GPTMoEConfig | None: ...


__all__ = [
    "GPTMoEConfig",
    "MoEFeedForward",
    "grouped_swiglu",
    "init_expert_weights",
    "is_moe_block",
]


@dataclass(frozen=True)
class GPTMoEConfig:
    """Where and how the reference GPT uses experts.

    Attributes:
        num_experts: experts per MoE layer.
        every: every ``every``-th block gets an MoE MLP (1: all blocks).
        k: experts per token.
        ep_size: expert-parallel ranks (must divide ``num_experts``).
        capacity_factor: capacity-based routing with this factor (DeepSpeed-MoE); None for
            dropless routing with grouped experts.
        min_capacity: least capacity per expert (capacity routing).
        aux_loss_coef: weight of the load-balancing loss added to the model's loss.
        z_loss_coef: weight of the router z-loss (dropless only).
    """

    num_experts: int = 8
    every: int = 2
    k: int = 2
    ep_size: int = 1
    capacity_factor: float | None = 1.0
    min_capacity: int = 4
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0

    def __post_init__(self) -> None:
        if self.num_experts < 1 or self.every < 1 or not 1 <= self.k <= self.num_experts:
            raise ConfigError(
                f"GPTMoEConfig num_experts={self.num_experts}, every={self.every}, k={self.k}: "
                "need num_experts >= 1, every >= 1 and 1 <= k <= num_experts"
            )
        if self.ep_size < 1 or self.num_experts % self.ep_size:
            raise ConfigError(
                f"GPTMoEConfig.ep_size={self.ep_size} must divide num_experts={self.num_experts}"
            )
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ConfigError(
                f"GPTMoEConfig.capacity_factor={self.capacity_factor} must be > 0, or None for "
                "dropless routing"
            )


def is_moe_block(config: _Shape, index: int) -> bool:
    """Whether block ``index`` has an MoE MLP."""
    return config.moe is not None and (index + 1) % config.moe.every == 0


class MoEFeedForward(nn.Module):
    """A block's MoE MLP: returns the output and keeps the weighted aux loss in ``aux_loss``."""

    def __init__(self, config: _Shape, dense_mlp: nn.Module) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None
        self.aux_loss_coef = moe.aux_loss_coef
        self.moe: MoE | DroplessMoE
        if moe.capacity_factor is None:
            router = RouterConfig(
                k=moe.k, aux_loss_coef=moe.aux_loss_coef, z_loss_coef=moe.z_loss_coef
            )
            self.moe = DroplessMoE(
                config.hidden_size,
                config.intermediate_size or 4 * config.hidden_size,
                moe.num_experts,
                moe.ep_size,
                router,
                activation="swiglu",
            )
        else:
            self.moe = MoE(
                config.hidden_size,
                dense_mlp,
                num_experts=moe.num_experts,
                ep_size=moe.ep_size,
                k=moe.k,
                capacity_factor=moe.capacity_factor,
                eval_capacity_factor=moe.capacity_factor,
                min_capacity=moe.min_capacity,
            )
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, aux, _ = self.moe(x)
        # DroplessMoE weighs its own losses; DeepSpeed's MoE returns the raw l_aux.
        self.aux_loss = aux if isinstance(self.moe, DroplessMoE) else self.aux_loss_coef * aux
        return out


def grouped_swiglu(experts: Sequence[nn.Module], rows: Tensor, counts: Tensor) -> Tensor:
    """Copies of the GPT's SwiGLU MLP as three grouped GEMMs (registered for ``MLP``)."""

    def stacked(name: str) -> Tensor:
        weights = [cast(nn.Linear, getattr(e, name)).weight for e in experts]
        return torch.stack(weights).transpose(1, 2)

    h = F.silu(grouped_mm(rows, stacked("gate_proj"), counts))
    h = h * grouped_mm(rows, stacked("up_proj"), counts)
    return grouped_mm(h, stacked("down_proj"), counts)


@torch.no_grad()
def init_expert_weights(module: nn.Module, std: float, out_std: float) -> None:
    """Initialise a grouped-experts module (N(0, std), the output projection ``out_std``),
    zero the dropless router's balancing buffers and mark the expert parameters."""
    if isinstance(module, MoE | DroplessMoE):
        # to_empty (after meta construction) made new parameters, without the expert marks.
        mark_expert_params(module.expert_module, module.expert_group_name)
    if isinstance(module, GroupedExperts):
        nn.init.normal_(module.w1, std=std)
        nn.init.normal_(module.w2, std=out_std)
        if module.w3 is not None:
            nn.init.normal_(module.w3, std=std)
    if isinstance(module, DroplessMoE):
        module.router.expert_bias.zero_()
        module.router.load.zero_()


def active_matmul_params(model: nn.Module) -> int:
    """Weights a token multiplies by: dense linears, plus k of each MoE layer's experts."""
    total = 0
    seen: set[int] = set()
    for m in model.modules():
        if isinstance(m, MoE):
            experts = m.deepspeed_moe.experts
            assert isinstance(experts, Experts)
            first = experts.deepspeed_experts[0]
            linears = [x for x in first.modules() if isinstance(x, nn.Linear)]
            gate = m.deepspeed_moe.gate
            assert isinstance(gate, TopKGate)
            total += m.k * sum(x.weight.numel() for x in linears) + gate.wg.weight.numel()
            seen.update(id(x) for x in m.modules())
        elif isinstance(m, DroplessMoE):
            ex = m.experts
            per_expert = sum(w[0].numel() for w in (ex.w1, ex.w2, ex.w3) if w is not None)
            total += m.router.cfg.k * per_expert + m.router.gate.weight.numel()
            seen.update(id(x) for x in m.modules())
    for m in model.modules():
        if isinstance(m, nn.Linear) and id(m) not in seen:
            total += m.weight.numel()
    return total
