"""AutoEP: Hugging Face MoE blocks to expert-parallel grouped experts (DeepSpeed's
``expert_parallel`` block).

Transformers 5 stores a block's routed experts as two stacked tensors,
``gate_up_proj [experts, 2 * ffn, hidden]`` and ``down_proj [experts, hidden, ffn]``, in an
experts module called as ``experts(hidden [tokens, hidden], top_k_index, top_k_weights)``
(Mixtral, Qwen3-MoE, Qwen2-MoE, Qwen3.5-MoE, DeepSeek-V2, DeepSeek-V3, MiniMax-M3).
:func:`convert_hf_moe_` replaces that module with :class:`AutoEPExperts`, which keeps the
same call, the same parameter names and this rank's ``experts / autoep_size`` slice of the
weights, and runs them with slipstream's dispatch: sort the (token, choice) pairs by expert,
exchange the counts, an uneven all-to-all over the expert-parallel group, one grouped GEMM
per projection (with the model's gated activation between them: SwiGLU, or MiniMax-M3's
clamped form), and the weighted combine in fp32.

The block's own router, shared experts and forward are kept, so the converted model computes
what the original does (the order of the per-token sum of the k expert outputs aside). When the
config changes the routing (``top_k``, ``score_func``, ``route_norm``, ``route_scale`` /
``routed_scaling_factor``, ``num_expert_groups``, ``num_limited_groups``) to something other
than what the model does, the router is replaced by :class:`AutoEPRouter` with those settings
and the model's router weight (and DeepSeek-V3's score-correction bias).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from slipstream.config._errors import ConfigError
from slipstream.config.expert import AUTOEP_PRESETS, ExpertParallelConfig
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

__all__ = ["PRESETS", "AutoEPExperts", "AutoEPRouter", "Preset", "convert_hf_moe_"]


@dataclass(frozen=True)
class Preset:
    """Where a model family keeps its MoE parts, and how it routes by default."""

    moe_layer_pattern: str
    router: str
    experts: str
    w_gate_up: str
    w_down: str
    num_experts_attr: str
    top_k_attr: str
    score_func: str
    route_norm: bool
    model_types: tuple[str, ...]


_LAYERS = r"model\.layers\.\d+\.mlp"
PRESETS: dict[str, Preset] = {
    "mixtral": Preset(
        _LAYERS, "gate", "experts", "gate_up_proj", "down_proj", "num_local_experts",
        "num_experts_per_tok", "softmax", True, ("mixtral",),
    ),
    "qwen3_moe": Preset(
        _LAYERS, "gate", "experts", "gate_up_proj", "down_proj", "num_experts",
        "num_experts_per_tok", "softmax", True, ("qwen3_moe", "qwen2_moe"),
    ),
    "qwen3_5_moe": Preset(
        _LAYERS, "gate", "experts", "gate_up_proj", "down_proj", "num_experts",
        "num_experts_per_tok", "softmax", True, ("qwen3_5_moe_text",),
    ),
    "deepseek_v2": Preset(
        _LAYERS, "gate", "experts", "gate_up_proj", "down_proj", "n_routed_experts",
        "num_experts_per_tok", "softmax", False, ("deepseek_v2",),
    ),
    "deepseek_v3": Preset(
        _LAYERS, "gate", "experts", "gate_up_proj", "down_proj", "n_routed_experts",
        "num_experts_per_tok", "sigmoid", False, ("deepseek_v3",),
    ),
    "minimax_m3": Preset(
        _LAYERS, "gate", "experts", "gate_up_proj", "down_proj", "num_local_experts",
        "num_experts_per_tok", "sigmoid", True, ("minimax_m3_vl_text",),
    ),
}  # fmt: skip
_COMPOSITE = {
    "qwen3_5_moe": "qwen3_5_moe_text",
    "minimax_m3_vl": "minimax_m3_vl_text",
}
"""Vision-language model types whose text backbone AutoEP converts (as DeepSpeed's presets)."""
assert tuple(PRESETS) == AUTOEP_PRESETS


class AutoEPExperts(nn.Module):
    """This rank's experts of one converted block, called like the Hugging Face experts module.

    Parameters keep the Hugging Face names, sliced on dim 0 to the local experts:
    ``gate_up_proj [local, 2 * ffn, hidden]``, ``down_proj [local, hidden, ffn]``. Local expert
    ``i`` is global expert ``ep_rank * local + i``.
    """

    def __init__(
        self,
        gate_up: Tensor,
        down: Tensor,
        act_fn: Callable[[Tensor], Tensor],
        num_experts: int,
        ep_size: int,
        ep_rank: int,
        names: tuple[str, str] = ("gate_up_proj", "down_proj"),
        clamp: tuple[float, float] | None = None,
    ) -> None:
        super().__init__()
        local = num_experts // ep_size
        self.num_experts = num_experts
        self.ep_size = ep_size
        self.ep_rank = ep_rank
        self.num_local_experts = local
        self.expert_group_name = f"ep_size_{ep_size}"
        self.names = names
        sl = slice(ep_rank * local, (ep_rank + 1) * local)
        self.register_parameter(names[0], nn.Parameter(gate_up.detach()[sl].clone()))
        self.register_parameter(names[1], nn.Parameter(down.detach()[sl].clone()))
        self.act_fn = act_fn
        self.clamp = clamp
        """``(alpha, limit)`` of MiniMax-M3's clamped SwiGLU (GPT-OSS's form), else None."""
        self.ep_group: comm.Group = None
        self.stats: RoutingStats | None = None
        # Set by ``expert_parallel_`` under tensor parallelism with ``ep_size`` > 1
        # (``slipstream.moe.tensor_parallel.TPTokenSplit``): how the rows reach the experts.
        self.exchange: Callable[..., Tensor] = exchange_and_run
        mark_expert_params(self, self.expert_group_name)

    @property
    def expert_module(self) -> nn.Module:
        return self

    def set_ep_group(self, ep_group: comm.Group) -> None:
        self.ep_group = ep_group

    def run_grouped(self, rows: Tensor, counts: list[int]) -> Tensor:
        """Local expert ``i`` on ``counts[i]`` consecutive rows (two grouped GEMMs)."""
        c = torch.tensor(counts, device=rows.device, dtype=torch.long)
        gate_up: Tensor = getattr(self, self.names[0])
        down: Tensor = getattr(self, self.names[1])
        gate, up = grouped_mm(rows, gate_up.transpose(1, 2), c).chunk(2, dim=-1)
        if self.clamp is None:
            h = self.act_fn(gate) * up
        else:  # (clamp(up, -l, l) + 1) * g * sigmoid(alpha * g), g = clamp(gate, max=l)
            alpha, limit = self.clamp
            gate = gate.clamp(max=limit)
            h = (up.clamp(-limit, limit) + 1.0) * gate * torch.sigmoid(gate * alpha)
        return grouped_mm(h, down.transpose(1, 2), c)

    def forward(self, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        if self.ep_size > 1 and comm.get_world_size(self.ep_group) != self.ep_size:
            raise RuntimeError(
                f"this AutoEP layer has autoep_size={self.ep_size} but no expert-parallel group "
                "of that size: apply slipstream.moe.expert_parallel_(model, mesh) first "
                "(slipstream.initialize does)"
            )
        idx = top_k_index.t().contiguous()
        idx = torch.where(idx >= self.num_experts, torch.full_like(idx, -1), idx)
        g = group_by_expert(idx, top_k_weights.t(), self.num_experts)
        out = self.exchange(self, gather_tokens(hidden, g), g.counts, self.ep_size, self.ep_group)
        self.stats = RoutingStats.of(g.counts, g.counts)
        return combine(out, g, hidden.shape[0], hidden.dtype)


class AutoEPRouter(nn.Module):
    """Top-k routing with AutoEP's settings; returns ``(logits, weights, indices)`` as the
    Hugging Face routers do.

    Scores are ``softmax`` or ``sigmoid`` of the fp32 logits. With groups, experts are split
    into ``num_expert_groups`` groups, each scored by the sum of its two best scores, and only
    the best ``num_limited_groups`` groups are eligible. The choice adds ``e_score_correction_bias``
    when the model has one; the weights are the chosen scores, renormalised (``route_norm``) and
    multiplied by ``route_scale``.
    """

    e_score_correction_bias: Tensor | None

    def __init__(
        self,
        weight: Tensor,
        top_k: int,
        score_func: str,
        route_norm: bool,
        route_scale: float,
        groups: tuple[int, int] | None,
        correction_bias: Tensor | None,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone())
        self.top_k, self.score_func = top_k, score_func
        self.route_norm, self.route_scale, self.groups = route_norm, route_scale, groups
        if correction_bias is not None:
            self.register_buffer("e_score_correction_bias", correction_bias.detach().clone())
        else:
            self.e_score_correction_bias = None

    def forward(self, hidden: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        x = hidden.reshape(-1, self.weight.shape[1])
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.softmax(-1) if self.score_func == "softmax" else logits.sigmoid()
        choose = scores
        if self.e_score_correction_bias is not None:
            choose = scores + self.e_score_correction_bias
        if self.groups is not None:
            n, keep = self.groups
            e = scores.shape[-1]
            group_scores = choose.view(-1, n, e // n).topk(min(2, e // n), dim=-1)[0].sum(-1)
            mask = torch.zeros_like(group_scores)
            mask.scatter_(1, group_scores.topk(keep, dim=-1)[1], 1.0)
            mask = mask.unsqueeze(-1).expand(-1, n, e // n).reshape(-1, e)
            choose = choose.masked_fill(mask == 0, float("-inf"))
        idx = choose.topk(self.top_k, dim=-1)[1]
        w = scores.gather(1, idx)
        if self.route_norm:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return logits, w * self.route_scale, idx


def detect_preset(model: nn.Module) -> str:
    """The preset whose model type matches ``model.config.model_type``."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    for name, preset in PRESETS.items():
        if model_type in preset.model_types:
            return name
    if model_type in _COMPOSITE:
        raise ConfigError(
            f"expert_parallel: model_type {model_type!r} is a vision-language model; AutoEP "
            f"converts its text backbone: pass the model with model_type "
            f"{_COMPOSITE[model_type]!r} (its language model), as DeepSpeed's preset requires"
        )
    raise ConfigError(
        f"config key 'expert_parallel.preset_model' is not set and model_type {model_type!r} "
        f"has no AutoEP preset: set preset_model to one of {list(PRESETS)} (or give "
        "moe_layer_pattern, router_pattern and expert_pattern)"
    )


def _hf_routing(router: nn.Module, cfg: Any, preset: Preset) -> dict[str, Any]:
    """What the model's own router does (as far as AutoEP's keys describe it)."""
    groups = None
    n, keep = getattr(router, "num_group", None), getattr(router, "topk_group", None)
    if n is not None and keep is not None and n > 1:
        groups = (int(n), int(keep))
    elif getattr(cfg, "topk_method", None) == "group_limited_greedy":
        groups = (int(cfg.n_group), int(cfg.topk_group))
    return {
        "top_k": int(getattr(router, "top_k", getattr(cfg, preset.top_k_attr, 0))),
        "score_func": preset.score_func,
        "route_norm": bool(getattr(router, "norm_topk_prob", preset.route_norm)),
        "route_scale": float(getattr(router, "routed_scaling_factor", 1.0) or 1.0),
        "groups": groups,
    }


def _wanted_routing(ep: ExpertParallelConfig, hf: dict[str, Any]) -> dict[str, Any]:
    want = dict(hf)
    if ep.top_k is not None:
        want["top_k"] = ep.top_k
    if ep.score_func != "auto":
        want["score_func"] = ep.score_func
    if ep.route_norm is not None:
        want["route_norm"] = ep.route_norm
    if ep.routed_scaling_factor != "auto":
        want["route_scale"] = float(ep.routed_scaling_factor)
    elif ep.route_scale != 1.0:
        want["route_scale"] = float(ep.route_scale)
    if ep.num_expert_groups is not None or ep.num_limited_groups is not None:
        n = ep.num_expert_groups or (hf["groups"] or (None, None))[0]
        keep = ep.num_limited_groups or (hf["groups"] or (None, None))[1]
        if n is None or keep is None:
            raise ConfigError(
                "config keys 'expert_parallel.num_expert_groups' and 'num_limited_groups' must "
                f"be set together (got {ep.num_expert_groups} and {ep.num_limited_groups})"
            )
        want["groups"] = (n, keep)
    return want


Replaced = dict[int, tuple[Tensor, nn.Parameter]]
"""``id(old parameter) -> (old, new)``; the old one is kept so that its id is not reused."""


def convert_hf_moe_(model: nn.Module, ep: ExpertParallelConfig, ep_rank: int) -> Replaced:
    """Convert every MoE block of the Hugging Face ``model`` in place (see the module doc).

    Returns the replaced parameters (for optimizers built before, see :func:`remap_params_`).

    Raises:
        ConfigError: no block matches, the experts are not stored the fused way, or
            ``autoep_size`` does not divide a block's experts.
    """
    preset = PRESETS[ep.preset_model or detect_preset(model)]
    pattern = re.compile(ep.moe_layer_pattern or preset.moe_layer_pattern)
    router_name = ep.router_pattern or preset.router
    experts_name = ep.expert_pattern or preset.experts
    w1 = ep.expert_w1 or preset.w_gate_up
    w2 = ep.expert_w2 or preset.w_down
    if ep.expert_w3 is not None:
        raise ConfigError(
            f"config key 'expert_parallel.expert_w3' = {ep.expert_w3!r}: slipstream's AutoEP "
            "converts experts stored fused (gate and up in one [experts, 2*ffn, hidden] "
            "tensor, Transformers 5's layout); leave expert_w3 unset"
        )
    cfg = getattr(model, "config", None)
    blocks = [
        (name, m)
        for name, m in model.named_modules()
        if pattern.fullmatch(name) and hasattr(m, experts_name) and hasattr(m, router_name)
    ]
    if not blocks:
        raise ConfigError(
            f"expert_parallel: no module matches moe_layer_pattern {pattern.pattern!r} with "
            f"children {router_name!r} and {experts_name!r}: check the preset_model "
            f"({ep.preset_model!r}) or the patterns"
        )
    replaced: Replaced = {}
    for name, block in blocks:
        hf_experts = getattr(block, experts_name)
        gate_up, down = getattr(hf_experts, w1, None), getattr(hf_experts, w2, None)
        if isinstance(gate_up, Tensor) and (gate_up.numel() == 0 or hasattr(gate_up, "ds_numel")):
            raise ConfigError(
                f"expert_parallel: {name}.{experts_name} is partitioned by ZeRO-3 (zero.Init): "
                "AutoEP converts full expert tensors; build the model outside zero.Init and "
                "use zero_optimization.stage 0-2 with expert_parallel"
            )
        if not isinstance(gate_up, Tensor) or not isinstance(down, Tensor) or gate_up.dim() != 3:
            raise ConfigError(
                f"expert_parallel: {name}.{experts_name} has no stacked {w1!r}/{w2!r} "
                "[experts, ...] tensors: slipstream's AutoEP converts Transformers 5's fused "
                "expert layout; set expert_w1/expert_w2 to its tensor names"
            )
        num_experts = gate_up.shape[0]
        if num_experts % ep.autoep_size:
            raise ConfigError(
                f"config key 'expert_parallel.autoep_size' = {ep.autoep_size} does not divide "
                f"num_experts={num_experts} of layer {name!r}: use a divisor of {num_experts}"
            )
        act = getattr(hf_experts, "act_fn", F.silu)
        clamp = _clamped_swiglu(hf_experts, ep, name)
        new = AutoEPExperts(
            gate_up, down, act, num_experts, ep.autoep_size, ep_rank, (w1, w2), clamp
        )
        replaced[id(gate_up)] = (gate_up, getattr(new, w1))
        replaced[id(down)] = (down, getattr(new, w2))
        setattr(block, experts_name, new)
        router = getattr(block, router_name)
        hf = _hf_routing(router, cfg, preset)
        want = _wanted_routing(ep, hf)
        if want != hf:
            bias = getattr(router, "e_score_correction_bias", None)
            new_router = AutoEPRouter(
                router.weight,
                want["top_k"],
                want["score_func"],
                want["route_norm"],
                want["route_scale"],
                want["groups"],
                bias if isinstance(bias, Tensor) else None,
            )
            replaced[id(router.weight)] = (router.weight, new_router.weight)
            setattr(block, router_name, new_router)
    return replaced


def _clamped_swiglu(
    hf_experts: nn.Module, ep: ExpertParallelConfig, name: str
) -> tuple[float, float] | None:
    """MiniMax-M3's experts compute GPT-OSS's clamped SwiGLU (``swiglu_alpha`` and
    ``swiglu_limit`` on the experts module); every other preset's the plain one. An
    ``expert_activation`` that names the other form is refused: the model computes its own."""
    alpha, limit = (
        getattr(hf_experts, "swiglu_alpha", None),
        getattr(hf_experts, "swiglu_limit", None),
    )
    clamp = None if alpha is None or limit is None else (float(alpha), float(limit))
    have = "swiglu" if clamp is None else "swiglu_oai"
    if ep.expert_activation is not None and ep.expert_activation != have:
        raise ConfigError(
            f"config key 'expert_parallel.expert_activation' = {ep.expert_activation!r}, but "
            f"the experts of {name!r} compute {have!r}: slipstream's AutoEP runs the model's "
            f"own activation; leave expert_activation unset or set it to {have!r}"
        )
    return clamp


def new_param(replaced: Replaced, p: Any) -> Any:
    """``p``'s replacement, or ``p``."""
    hit = replaced.get(id(p))
    return hit[1] if hit is not None and hit[0] is p else p


def remap_params_(groups: list[dict[str, Any]], replaced: Replaced) -> None:
    """Point optimizer param groups built before the conversion at the new parameters."""
    for g in groups:
        g["params"] = [new_param(replaced, p) for p in g["params"]]


def autoep_(model: nn.Module, ep: ExpertParallelConfig, mesh: Any) -> Replaced:
    """:func:`convert_hf_moe_` with this rank's expert-parallel rank taken from ``mesh``'s
    groups of ``autoep_size`` (a collective call the first time, as ``expert_parallel_``)."""
    from slipstream.distributed.expert import expert_groups

    groups = expert_groups(mesh, ep.autoep_size)
    ep_rank = comm.get_rank(groups.ep_group) if groups.ep_group is not None else 0
    return convert_hf_moe_(model, ep, ep_rank)
