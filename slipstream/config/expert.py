"""``expert_parallel``: DeepSpeed 0.19.8's AutoEP block (its keys and defaults).

With ``enabled`` true, ``slipstream.initialize`` converts each Hugging Face MoE block of the
model (Mixtral, Qwen3-MoE / Qwen2-MoE, Qwen3.5-MoE, DeepSeek-V2, DeepSeek-V3, MiniMax-M3)
to expert-parallel grouped experts over ``autoep_size`` ranks (:mod:`slipstream.moe.autoep`).
Keys that only choose a kernel or an implementation detail in DeepSpeed (``use_grouped_mm``,
``combine_impl``, ``gate_up_impl``, the ``comm_*`` budgets) are accepted and leave the
results unchanged; keys that would change what is computed and that slipstream does not
build are refused by name.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from slipstream.config._base import StrictModel
from slipstream.config._errors import ConfigError

__all__ = ["AUTOEP_PRESETS", "ExpertParallelConfig"]

AUTOEP_PRESETS = ("mixtral", "qwen3_moe", "qwen3_5_moe", "deepseek_v2", "deepseek_v3", "minimax_m3")
"""The presets slipstream converts: DeepSpeed 0.19.8's."""


class ExpertParallelConfig(StrictModel):
    """``expert_parallel`` (AutoEP). Defaults are DeepSpeed 0.19.8's."""

    enabled: bool = False
    autoep_size: int = Field(1, ge=1)
    """Expert-parallel ranks; must divide the data-parallel size and every layer's experts."""
    expert_tensor_parallel_size: Literal[1] = 1
    """Expert tensor parallelism is not built (must be 1)."""
    validate_folding_routing: bool = False
    """DeepSpeed's check of AutoEP+AutoTP folding; slipstream does not fold (no effect)."""
    async_split_plan: bool = False
    """How DeepSpeed computes its split plan; no effect on results here."""
    preset_model: str | None = None
    """One of ``AUTOEP_PRESETS``; None detects it from the model's ``model_type``."""
    moe_layer_pattern: str | None = None
    """Regex (full match) over module names selecting the MoE blocks."""
    expert_pattern: str | None = None
    """Child name of the experts module in a block (preset: ``experts``)."""
    router_pattern: str | None = None
    """Child name of the router in a block (preset: ``gate``)."""
    use_grouped_mm: bool = True
    disable_triton_grouped_mm: bool = False
    route_norm: bool | None = None
    """Renormalise each token's top-k weights; None takes the model's own setting."""
    route_scale: float = 1.0
    score_apply: Literal["auto", "pre", "post"] = "auto"
    combine_impl: Literal["auto", "weighted_sum", "fused_weighted_sum", "legacy_bmm"] = "auto"
    row_weighting_impl: Literal["auto", "eager", "fused"] = "auto"
    gate_up_impl: Literal["separate", "fused"] = "separate"
    comm_backend: Literal["comm", "deepep"] = "comm"
    comm_num_sm: int = Field(12, ge=1)
    comm_qp_margin: int = Field(4, ge=0)
    comm_max_tokens_per_rank: int = Field(0, ge=0)
    num_expert_groups: int | None = Field(None, ge=1)
    num_limited_groups: int | None = Field(None, ge=1)
    score_func: Literal["auto", "softmax", "sigmoid"] = "auto"
    top_k: int | None = None
    """Experts per token; "auto" (DeepSpeed's default, read as None) takes the model's."""
    load_balance_coeff: None = None
    """Aux-loss-free balancing through AutoEP is refused by DeepSpeed 0.19.8 too (null only)."""
    routed_scaling_factor: float | Literal["auto"] = "auto"
    expert_w1: str | None = None
    expert_w2: str | None = None
    expert_w3: str | None = None
    num_experts_attr: str | None = None
    top_k_attr: str | None = None
    has_shared_experts: bool | None = None
    shared_experts_pattern: str | None = None
    shared_experts_gate_pattern: str | None = None
    expert_activation: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _ints_as_floats(cls, data: object) -> object:
        if isinstance(data, dict):
            data = dict(data)
            if data.get("top_k") == "auto":
                data["top_k"] = None
            for key in ("route_scale", "routed_scaling_factor"):
                if isinstance(data.get(key), int) and not isinstance(data.get(key), bool):
                    data[key] = float(data[key])
        return data

    @model_validator(mode="after")
    def _check(self) -> ExpertParallelConfig:
        if not self.enabled:
            return self
        p = self.preset_model
        if p is not None and p not in AUTOEP_PRESETS:
            raise ConfigError(
                f"config key 'expert_parallel.preset_model' = {p!r}: unknown preset; "
                f"available: {list(AUTOEP_PRESETS)}"
            )
        refusals = {
            "comm_backend": (self.comm_backend == "deepep", "DeepEP is not available; use 'comm'"),
            "row_weighting_impl": (
                self.row_weighting_impl == "fused",
                "it runs only inside DeepEP; leave it 'auto'",
            ),
            "score_apply": (
                self.score_apply == "pre",
                "scaling expert inputs by the routing score is not built; use 'post' or 'auto'",
            ),
        }
        for key, (bad, fix) in refusals.items():
            if bad:
                value = getattr(self, key)
                raise ConfigError(f"config key 'expert_parallel.{key}' = {value!r}: {fix}")
        if self.gate_up_impl == "fused" and not self.use_grouped_mm:
            raise ConfigError(
                "config key 'expert_parallel.gate_up_impl' = 'fused' needs use_grouped_mm "
                "true: set use_grouped_mm to true or leave gate_up_impl 'separate'"
            )
        if self.expert_activation not in (None, "swiglu", "swiglu_oai"):
            raise ConfigError(
                f"config key 'expert_parallel.expert_activation' = {self.expert_activation!r}: "
                "slipstream's AutoEP runs the model's own gated activation ('swiglu', or "
                "MiniMax-M3's clamped 'swiglu_oai'); leave it unset or name the model's"
            )
        if (
            self.num_limited_groups is not None
            and self.num_expert_groups is not None
            and self.num_limited_groups > self.num_expert_groups
        ):
            raise ConfigError(
                f"config key 'expert_parallel.num_limited_groups' = {self.num_limited_groups} "
                f"must be <= num_expert_groups ({self.num_expert_groups})"
            )
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError(f"config key 'expert_parallel.top_k' = {self.top_k} must be >= 1")
        return self
