"""Typed ``zero_optimization`` block (DeepSpeed key names, validated)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from slipstream._logging import logger
from slipstream.config._base import StrictModel

__all__ = ["LeafModuleConfig", "OffloadConfig", "ZeroConfig"]

DEFAULT_LEAF_MODULE_CLASSES: list[str] = [
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
]
"""DeepSpeed's default ZeRO-3 leaf classes: Hugging Face's sparse MoE blocks."""


class LeafModuleConfig(StrictModel):
    """``zero_optimization.leaf_module``: modules gathered as one ZeRO-3 unit, by class
    (name or ``module.Class``), by module name or by name suffix. A single string is a list of
    one; duplicates are dropped. Stage 3 marks them at ``initialize``."""

    classes: list[str] = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_CLASSES))
    """Class names (``Class`` or ``module.Class``); DeepSpeed's default names HF MoE blocks."""
    names: list[str] = Field(default_factory=list)
    """``named_modules()`` names."""
    name_suffixes: list[str] = Field(default_factory=list)
    """Suffixes of ``named_modules()`` names."""

    @field_validator("classes", "names", "name_suffixes", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [value]
        if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
            return list(dict.fromkeys(value))
        return value


class OffloadConfig(StrictModel):
    """``offload_optimizer`` / ``offload_param``: where states or parameters live."""

    e_notation = frozenset({"buffer_size", "max_in_cpu"})

    device: Literal["none", "cpu", "nvme"] = "none"
    """Target device; ``none`` disables offload."""
    nvme_path: str | None = None
    """Directory for swap files when ``device`` is ``nvme``."""
    buffer_count: int = Field(4, ge=1)
    """Number of swap buffers."""
    buffer_size: int = Field(100_000_000, ge=1)
    """Elements per parameter swap buffer."""
    max_in_cpu: int = Field(1_000_000_000, ge=0)
    """Parameter elements kept in CPU memory when swapping to NVMe."""
    pin_memory: bool = False
    """Page-lock host buffers for faster device copies."""
    pipeline_read: bool = False
    """Overlap NVMe reads with the optimizer step."""
    pipeline_write: bool = False
    """Overlap NVMe writes with the optimizer step."""
    fast_init: bool = False
    """Skip staging through CPU memory at initialization."""
    ratio: float = Field(1.0, gt=0.0, le=1.0)
    """Fraction of optimizer states offloaded (partial offload; stage 3 only)."""

    @property
    def enabled(self) -> bool:
        return self.device != "none"

    @property
    def pipeline(self) -> bool:
        """DeepSpeed's name: NVMe reads or writes overlap the optimizer step."""
        return self.pipeline_read or self.pipeline_write


class ZeroConfig(StrictModel):
    """ZeRO data parallelism (Rajbhandari et al. 2020, sections 5.1-5.3).

    Stage 0 replicates everything and all-reduces gradients; stage 1 partitions the
    optimizer states and fp32 master weights across data-parallel ranks; stage 2 also
    reduce-scatters gradients into per-rank partitions during backward; stage 3 also
    partitions the parameters.
    """

    e_notation = frozenset(
        {
            "reduce_bucket_size",
            "allgather_bucket_size",
            "sub_group_size",
            "stage3_prefetch_bucket_size",
            "stage3_param_persistence_threshold",
            "stage3_model_persistence_threshold",
            "stage3_max_live_parameters",
            "stage3_max_reuse_distance",
            "stage3_module_granularity_threshold",
        }
    )

    stage: int = Field(0, ge=0, le=3)
    """ZeRO stage, 0 to 3."""
    contiguous_gradients: bool = True
    """Accumulate gradients in one flat buffer (always true in slipstream: it is how buckets work)."""
    overlap_comm: bool | None = None
    """Launch each bucket's reduction asynchronously as soon as it is full (None: true)."""
    reduce_scatter: bool = True
    """Stage 2: reduce-scatter (true) rather than all-reduce gradient buckets."""
    reduce_bucket_size: int = Field(500_000_000, ge=1)
    """Elements per gradient-reduction bucket."""
    allgather_partitions: bool = True
    """Stage 1/2: all-gather updated partitions (true) rather than broadcast them."""
    allgather_bucket_size: int = Field(500_000_000, ge=1)
    """Elements per parameter all-gather after the step."""
    use_multi_rank_bucket_allreduce: bool = True
    """Accepted for compatibility; slipstream buckets always span ranks."""
    load_from_fp32_weights: bool = True
    """Initialize master weights from saved fp32 weights when loading a checkpoint."""
    elastic_checkpoint: bool = False
    """Accepted for compatibility; slipstream checkpoints are always reshardable."""
    round_robin_gradients: bool = False
    """Accepted for compatibility: a DeepSpeed CPU-offload scheduling knob."""
    ignore_unused_parameters: bool = True
    """Parameters that get no gradient are reduced as zeros instead of raising."""
    sub_group_size: int = Field(1_000_000_000, ge=1)
    """Optimizer-step granularity in elements (offload)."""
    stage3_prefetch_bucket_size: int = Field(50_000_000, ge=0, alias="prefetch_bucket_size")
    """Stage 3: elements prefetched ahead of use."""
    stage3_param_persistence_threshold: int = Field(
        100_000, ge=0, alias="param_persistence_threshold"
    )
    """Stage 3: parameters smaller than this stay unpartitioned."""
    stage3_model_persistence_threshold: int = Field(
        2**63 - 1, ge=0, alias="model_persistence_threshold"
    )
    """Stage 3: cap on total unpartitioned elements."""
    stage3_max_live_parameters: int = Field(1_000_000_000, ge=0, alias="max_live_parameters")
    """Stage 3: cap on gathered elements alive at once."""
    stage3_max_reuse_distance: int = Field(1_000_000_000, ge=0, alias="max_reuse_distance")
    """Stage 3: keep a gathered parameter if reused within this distance."""
    stage3_gather_16bit_weights_on_model_save: bool = Field(
        False, alias="gather_16bit_weights_on_model_save"
    )
    """Stage 3: gather full 16-bit weights in ``save_16bit_model``."""
    stage3_module_granularity_threshold: int = Field(0, ge=0, alias="module_granularity_threshold")
    """Stage 3: automatic leaf-module grouping threshold."""
    stage3_use_all_reduce_for_fetch_params: bool = Field(
        False, alias="use_all_reduce_for_fetch_params"
    )
    """Stage 3: fetch parameters with all-reduce instead of all-gather."""
    stage3_allgather_sequential: bool = Field(False, alias="allgather_sequential")
    """Stage 3: gather parameters one at a time."""
    offload_param: OffloadConfig | None = None
    """Parameter offload (stage 3 only)."""
    offload_optimizer: OffloadConfig | None = None
    """Optimizer-state offload."""
    zero_hpz_partition_size: int = Field(1, ge=1)
    """ZeRO++ hpZ: ranks (consecutive, usually one node) sharing a secondary copy of the
    weights so the backward all-gather stays inside them; 1 disables."""
    zero_quantized_weights: bool = False
    """ZeRO++ qwZ: all-gather stage-3 weights as int8 block-quantized codes."""
    zero_quantized_weights_block_size: int = Field(2048, ge=2)
    """qwZ elements per quantization block (slipstream key)."""
    zero_quantized_nontrainable_weights: bool = False
    """ZeRO++: frozen (requires_grad=False) weights stored as int8 block codes at stage 3,
    dequantized per unit while it runs (half of bf16's memory, a quarter of fp32's)."""
    zero_quantized_gradients: bool = False
    """ZeRO++ qgZ: reduce-scatter gradients as a 2-hop int4 all-to-all (multi-node only)."""
    zero_quantized_gradients_block_size: int = Field(512, ge=2)
    """qgZ elements per quantization block (slipstream key; even)."""
    mics_shard_size: int = -1
    """MiCS shard group size; -1 disables."""
    mics_hierarchical_params_gather: bool = False
    """MiCS hierarchical all-gather."""
    memory_efficient_linear: bool = True
    """Accepted for compatibility (a DeepSpeed stage-3 autograd detail)."""
    override_module_apply: bool = True
    """Accepted for compatibility (a DeepSpeed stage-3 detail)."""
    log_trace_cache_warnings: bool = False
    """Accepted for compatibility; slipstream's prefetch never warns about trace caches."""
    enable_sanity_checks: bool = False
    """Extra cross-rank consistency checks."""
    leaf_module: LeafModuleConfig = Field(default_factory=LeafModuleConfig)
    """Stage 3: modules gathered as one unit (see ``LeafModuleConfig``)."""

    @model_validator(mode="after")
    def _elastic_checkpoint_note(self) -> ZeroConfig:
        if self.stage == 3 and self.elastic_checkpoint:
            logger.warning(
                "zero_optimization.elastic_checkpoint: ZeRO-3 elastic checkpointing is "
                "deprecated in DeepSpeed; slipstream's checkpoints reshard to any world size "
                "and stage, so the key has no effect"
            )
        return self

    @property
    def overlap(self) -> bool:
        """Resolved ``overlap_comm`` (DeepSpeed's default is true only at stage 3; ours is true)."""
        return True if self.overlap_comm is None else self.overlap_comm
