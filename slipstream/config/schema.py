"""The typed top-level training config (DeepSpeed JSON key names)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from slipstream.config._base import StrictModel
from slipstream.config.aio import AioConfig
from slipstream.config.autotuning import AutotuningConfig
from slipstream.config.compression import CompressionConfig
from slipstream.config.expert import ExpertParallelConfig
from slipstream.config.hybrid import HybridEngineConfig
from slipstream.config.monitor import (
    CometConfig,
    CSVMonitorConfig,
    FlopsProfilerConfig,
    TensorBoardConfig,
    WandbConfig,
)
from slipstream.config.parallel import (
    ActivationCheckpointingConfig,
    PipelineConfig,
    TensorParallelConfig,
    TiledComputeConfig,
)
from slipstream.config.precision import BF16Config, DataTypesConfig, FP16Config
from slipstream.config.zero import ZeroConfig

__all__ = [
    "GRADIENT_CLIPPING_DEFAULT",
    "NOT_YET_IMPLEMENTED",
    "CommsLoggerConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "SlipstreamConfig",
]


class OptimizerConfig(StrictModel):
    """``optimizer`` block: a name (case-insensitive) and its constructor keyword arguments."""

    type: str
    """Adam, AdamW, SGD, Lamb, Lion, Adagrad, or any ``torch.optim`` class name."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the optimizer (lr, betas, eps, weight_decay, ...)."""


class SchedulerConfig(StrictModel):
    """``scheduler`` block: a name and its keyword arguments."""

    type: str
    """WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest, or a ``torch.optim.lr_scheduler`` name."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the scheduler."""


class CommsLoggerConfig(StrictModel):
    """``comms_logger``: per-collective byte and call counters, printed by ``comm.log_summary()``."""

    enabled: bool = False
    """Print the communication summary every ``steps_per_print`` steps."""
    verbose: bool = False
    """Log every collective as it is issued."""
    prof_all: bool = True
    """Count every collective (otherwise only those in ``prof_ops``)."""
    prof_ops: list[str] = Field(default_factory=list)
    """Collective names to count when ``prof_all`` is false."""
    debug: bool = False
    """Include the call site label in verbose logs."""


class CheckpointConfig(StrictModel):
    """``checkpoint``: how ``save_checkpoint`` / ``load_checkpoint`` behave."""

    tag_validation: Literal["Warn", "Ignore", "Fail"] = "Warn"
    """What to do when ranks pass different tags: log a warning (and use rank 0's), ignore,
    or raise."""

    @field_validator("tag_validation", mode="before")
    @classmethod
    def _any_case(cls, value: object) -> object:
        """DeepSpeed upper-cases the value, so "FAIL", "fail" and "Fail" all mean Fail."""
        return value.capitalize() if isinstance(value, str) else value

    load_universal: bool = False
    """Accepted for compatibility: every slipstream checkpoint loads at any world size/stage."""
    use_node_local_storage: bool = False
    """Not supported: checkpoints go to a directory every rank can reach."""
    keep_last: int | None = Field(default=None, ge=1)
    """Keep only the newest N tags in ``save_dir`` (deleted after a successful save)."""
    async_save: bool = False
    """Write shard files in a background thread (after an in-memory snapshot) while training
    goes on; committed by the next save/load/destroy or ``engine.wait_for_checkpoint()``."""
    barrier_timeout: float = Field(default=300.0, gt=0)
    """Seconds to wait for every rank to enter save/load before naming the missing ranks."""
    load_rng_state: bool = True
    """(slipstream) ``load_checkpoint`` restores each rank's RNG states (same world size), so
    a resumed run draws the dropout masks an uninterrupted one would. False: leave the RNG
    alone, as DeepSpeed does."""


# DeepSpeed clips the global gradient norm at 1.0 when the config has no "gradient_clipping"
# key since 0.19.3 (deepspeedai/DeepSpeed#8068; 0.19.2 and earlier did not clip). slipstream
# follows DeepSpeed 0.19.8 (slipstream.version.DEEPSPEED_VERSION): the same config must train
# the same way. parse_config logs once when this default is applied.
GRADIENT_CLIPPING_DEFAULT = 1.0

# DeepSpeed top-level keys that slipstream knows but does not implement yet, with where they
# land. A block whose "enabled" is false (or a trivial value) is accepted; anything else is an
# error saying so, never a silent drop.
NOT_YET_IMPLEMENTED: dict[str, str] = {
    "amp": "Apex AMP is not supported; use bf16 or fp16",
    "torch_autocast": "torch_autocast is not implemented yet; use bf16 or fp16",
    "compile": "DeepCompile options are not implemented yet",
    "elasticity": "elastic training is not implemented yet",
    "data_efficiency": "data efficiency is not implemented yet",
    "curriculum_learning": "curriculum learning is not implemented yet",
    "progressive_layer_drop": "progressive layer drop is not implemented yet",
    "sparse_attention": "DeepSpeed's block-sparse attention (Triton kernels read by the model code through deepspeed.ops.sparse_attention) is not implemented; use dense attention (torch scaled_dot_product_attention), or slipstream.sequence (Ulysses, LSS) for long sequences",
    "eigenvalue": "eigenvalue computation is not implemented yet",
    "quantize_training": "quantization-aware training is not implemented yet",
    "timers": "timer options are not implemented yet; use wall_clock_breakdown",
    "dump_state": "dump_state is not implemented yet",
}


class SlipstreamConfig(StrictModel):
    """A whole training config. Build it with ``slipstream.config.parse_config``.

    After parsing, the batch triple is resolved: all three sizes are set and
    ``train_batch_size == train_micro_batch_size_per_gpu * gradient_accumulation_steps * dp``.
    """

    train_batch_size: int | None = Field(None, ge=1)
    """Global batch per optimizer step (micro batch x accumulation x data-parallel size)."""
    train_micro_batch_size_per_gpu: int | None = Field(None, ge=1)
    """Samples per rank per forward/backward."""
    gradient_accumulation_steps: int | None = Field(None, ge=1)
    """Micro-steps per optimizer step."""
    steps_per_print: int | None = Field(None, ge=1)
    """Log loss, lr and throughput every N optimizer steps (None: never)."""
    optimizer: OptimizerConfig | None = None
    """Optimizer built by ``initialize`` when no client optimizer is given."""
    scheduler: SchedulerConfig | None = None
    """LR scheduler built by ``initialize`` when no client scheduler is given."""
    gradient_clipping: float = Field(GRADIENT_CLIPPING_DEFAULT, ge=0.0)
    """Clip the global gradient norm (over all ranks) to this value; 0 disables. Absent: 1.0,
    DeepSpeed's default since 0.19.3 (it did not clip before)."""
    nonfinite_gradients: Literal["skip", "error"] = "skip"
    """(slipstream) What an optimizer step does when the global gradient norm is inf or nan
    (a non-finite loss or gradient on any rank) in fp32, bf16 or fp16 with a static loss
    scale: "skip" leaves parameters, optimizer state and the lr schedule unchanged on every
    rank, counts ``skipped_steps`` and logs a warning naming the step (as fp16 overflow
    does); "error" raises ``NonFiniteGradientError`` on every rank. fp16 with dynamic loss
    scaling always skips: an overflow is how it finds the scale."""
    fp16: FP16Config = Field(default_factory=FP16Config)
    """fp16 mixed precision."""
    bf16: BF16Config = Field(default_factory=BF16Config, alias="bfloat16")
    """bf16 mixed precision (``bfloat16`` is the deprecated name)."""
    data_types: DataTypesConfig = Field(default_factory=DataTypesConfig)
    """dtype overrides."""
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    """ZeRO stage and bucket settings."""
    zero_allow_untested_optimizer: bool = False
    """Accept an optimizer class not known to be elementwise on flat ZeRO partitions."""
    zero_force_ds_cpu_optimizer: bool = True
    """Accepted for compatibility (offload)."""
    prescale_gradients: bool = False
    """Divide gradients by ``gradient_predivide_factor`` before reduction."""
    gradient_predivide_factor: float = Field(1.0, gt=0.0)
    """Pre-division factor (the rest of 1/world is applied after reduction)."""
    gradient_allreduce_op: Literal["mean", "sum"] = "mean"
    """How data-parallel gradients combine: "mean" (DeepSpeed's default) or "sum", any case.
    "sum" is refused at ZeRO stage 3 (as by DeepSpeed), with MoE experts and with sequence
    parallelism."""

    @field_validator("gradient_allreduce_op", mode="before")
    @classmethod
    def _allreduce_op(cls, value: object) -> object:
        op = value.lower() if isinstance(value, str) else value
        if op not in ("mean", "sum"):
            raise ValueError(f"Invalid gradient_allreduce_op {value!r}: use 'mean' or 'sum'")
        return op

    communication_data_type: Literal["fp32", "fp16", "bf16"] | None = None
    """dtype of gradient reductions (None: the gradient accumulation dtype)."""
    sparse_gradients: bool = False
    """Sparse embedding gradients (not supported: must stay false)."""
    wall_clock_breakdown: bool = False
    """Time forward, backward and step and log them every ``steps_per_print`` steps."""
    memory_breakdown: bool = False
    """Log this rank's memory at the forward/backward/step boundaries and its model-state
    bytes against the ZeRO estimator, with every step line (``steps_per_print``)."""
    comms_logger: CommsLoggerConfig = Field(default_factory=CommsLoggerConfig)
    """Communication counters."""
    aio: AioConfig | None = None
    """DeepSpeed's NVMe I/O tuning, accepted at its defaults (``slipstream.config.aio``)."""
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    """TensorBoard monitor (rank 0 writes ``Train/Samples/*`` scalars)."""
    csv_monitor: CSVMonitorConfig = Field(default_factory=CSVMonitorConfig)
    """CSV monitor: one file per scalar."""
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    """Weights & Biases monitor."""
    comet: CometConfig = Field(default_factory=CometConfig)
    """Comet ML monitor."""
    flops_profiler: FlopsProfilerConfig = Field(default_factory=FlopsProfilerConfig)
    """FLOPs profiler of one step, then MFU in the step log."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Checkpoint behaviour: tag validation, retention, the rank-arrival timeout."""
    seed: int | None = None
    """Seed torch's RNG on every rank and the data sampler."""
    dataloader_drop_last: bool = False
    """Drop the last incomplete batch of the dataloader ``initialize`` builds."""
    sequence_parallel_size: int = Field(1, ge=1)
    """Ranks that share one sequence (Ulysses or LSS attention, ``slipstream.sequence``);
    must divide the world size. ZeRO shards over the data- and sequence-parallel ranks."""
    sequence_parallel_mode: Literal["ulysses", "ring"] = "ulysses"
    """(slipstream) How the ``sequence_parallel_size`` ranks attend over the sharded sequence:
    "ulysses" (all-to-all over heads; heads must split over the ranks) or "ring" (ring
    attention / context parallelism with a zig-zag split, any head count; Ulysses x ring when
    ``sequence_parallel_ring_size`` is smaller than ``sequence_parallel_size``)."""
    sequence_parallel_ring_size: int | None = Field(None, ge=1)
    """(slipstream) With ``sequence_parallel_mode: "ring"``: the ranks of one ring (must divide
    ``sequence_parallel_size``; the rest is the Ulysses degree inside each ring step, USP).
    None: the whole ``sequence_parallel_size`` (pure ring)."""
    data_parallel_size: int | None = Field(None, ge=1)
    """Data-parallel size; None (or "auto") takes world / (sp x tp x pp). A number must equal
    it: the mesh is fully determined by the other sizes, this key only double-checks it."""
    autotuning: AutotuningConfig = Field(default_factory=AutotuningConfig)
    """DeepSpeed's autotuner block, used by ``slipstream tune`` only (training ignores it, as
    DeepSpeed does outside ``deepspeed --autotuning``)."""
    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig)
    """Tensor parallelism (AutoTP)."""
    expert_parallel: ExpertParallelConfig = Field(default_factory=ExpertParallelConfig)
    """AutoEP: Hugging Face MoE blocks converted to expert-parallel grouped experts."""
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    """Pipeline schedule for a ``PipelineModule`` model."""
    hybrid_engine: HybridEngineConfig = Field(default_factory=HybridEngineConfig)
    """DeepSpeed-Chat's hybrid engine: ``engine.generate`` on a ZeRO actor (``slipstream.rlhf``)."""
    activation_checkpointing: ActivationCheckpointingConfig = Field(
        default_factory=ActivationCheckpointingConfig
    )
    """Options of ``slipstream.checkpointing`` (activation recomputation)."""
    tiled_compute: TiledComputeConfig = Field(default_factory=TiledComputeConfig)
    """(slipstream) Tiled MLP and tiled logits+loss for Hugging Face causal LMs."""
    compression_training: CompressionConfig = Field(default_factory=CompressionConfig)
    """DeepSpeed's compression library (``deepspeed.compression``, docs/compression.md): the
    engine turns each technique on at its ``schedule_offset``."""
    managed_gradient_accumulation: bool = True
    """The engine counts micro-steps; false makes every ``step()`` a boundary."""

    def get(self, key: str, default: Any = None) -> Any:
        """DeepSpeed's ``engine.config`` is the config dict: ``config.get("zero_optimization",
        {}).get("stage")`` (the Hugging Face Trainer does this) reads this config as a dict
        of its DeepSpeed keys (a copy; edits do not reach the engine)."""
        return self.model_dump().get(key, default)

    @property
    def batch(self) -> tuple[int, int, int]:
        """(train_batch_size, micro batch, accumulation steps), resolved."""
        assert self.train_batch_size and self.train_micro_batch_size_per_gpu
        assert self.gradient_accumulation_steps
        return (
            self.train_batch_size,
            self.train_micro_batch_size_per_gpu,
            self.gradient_accumulation_steps,
        )
