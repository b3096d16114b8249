"""Typed config blocks for model parallelism: ``tensor_parallel``, ``pipeline``,
``activation_checkpointing`` (DeepSpeed key names; slipstream extensions are marked)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from slipstream.config._base import StrictModel
from slipstream.config._errors import ConfigError

__all__ = [
    "ActivationCheckpointingConfig",
    "PipelineConfig",
    "TensorParallelConfig",
    "TiledComputeConfig",
    "check_parallel_config",
]


class TensorParallelConfig(StrictModel):
    """``tensor_parallel``: split each layer's matrices across ``autotp_size`` ranks.

    ``slipstream.initialize`` applies ``slipstream.parallel.tensor.parallelize_tp_`` with the
    model's built-in or automatic plan (reference GPT, HF LLaMA-family, GPT-2) before ZeRO
    shards what is left over the data-parallel ranks.
    """

    autotp_size: int = Field(1, ge=1)
    """Tensor-parallel size (ranks per layer); must divide the world size. 1 disables."""
    sequence_parallel: bool = False
    """(slipstream) Megatron-style sequence parallelism inside the tensor-parallel group:
    norms and residual dropout run on 1/autotp_size of the sequence, which cuts their
    activation memory by that factor at the same communication volume."""
    tp_overlap_comm: Literal[False] = False
    """Accepted for compatibility; overlapping TP collectives with compute is not implemented
    (must be false)."""


class PipelineConfig(StrictModel):
    """``pipeline``: how a ``PipelineModule`` is scheduled (stages come from the module)."""

    stages: int | None = Field(None, ge=1, alias="num_stages")
    """Pipeline stages (also read as ``num_stages``); None (or "auto") takes the
    ``PipelineModule``'s ``num_stages``. A number must equal it."""
    schedule: Literal["1f1b", "gpipe", "interleaved"] = "1f1b"
    """(slipstream) "1f1b" (one-forward-one-backward, DeepSpeed's only schedule), "gpipe"
    (all forwards, then all backwards: simplest, most activation memory) or "interleaved"
    (1F1B over ``virtual_stages`` model chunks per rank: smaller bubble, more messages)."""
    virtual_stages: int = Field(1, ge=1)
    """(slipstream) Model chunks per rank for the interleaved schedule (the module's
    ``virtual_stages`` must match); 1 for the other schedules."""
    activation_checkpoint_interval: int = Field(0, ge=0)
    """Recompute every this many layers in backward (0: the module's own setting)."""
    partition: str = "best"
    """How layers are cut into stages: "best" (DeepSpeed's default) takes the
    ``PipelineModule``'s ``partition_method``; any other value ("parameters", "uniform",
    "type:<regex>") must equal it (the module is built, and split, before the config is
    read)."""
    seed_layers: bool = False
    """true requires a ``PipelineModule(seed_layers=True)`` (each layer seeded with
    ``base_seed + index``, so initialization does not depend on the partitioning)."""
    pipe_partitioned: bool = True
    """Under tensor parallelism, send 1/tp of each activation between stages per TP rank
    and all-gather it on the receiving stage (tp times fewer bytes between stages)."""
    grad_partitioned: bool = True
    """The same for the gradients sent back between stages."""


class ActivationCheckpointingConfig(StrictModel):
    """``activation_checkpointing``: options of ``slipstream.checkpointing.checkpoint``.

    Takes effect where the model checkpoints: ``slipstream.checkpointing.checkpoint`` calls,
    the reference GPT with ``activation_checkpointing=True``, and ``PipelineModule``'s
    ``activation_checkpoint_interval``.
    """

    partition_activations: bool = False
    """Under tensor parallelism, keep only 1/tp of each checkpointed input (identical on all
    TP ranks) and all-gather it for the recompute."""
    cpu_checkpointing: bool = False
    """Keep checkpointed inputs in host memory until the recompute (page-locked buffers and
    asynchronous copies on an accelerator; on a CPU they are in host memory already). Hugging
    Face models: applies to the layers ``gradient_checkpointing_enable`` checkpoints."""
    contiguous_memory_optimization: Literal[False] = False
    """Not needed with PyTorch's caching allocator (must be false)."""
    number_checkpoints: int | None = Field(None, ge=1)
    """Accepted for compatibility: a buffer-size hint DeepSpeed's contiguous mode used."""
    synchronize_checkpoint_boundary: bool = False
    """Synchronize the accelerator before and after each checkpointed region (debugging)."""
    profile: bool = False
    """Log the time spent in checkpointed forwards and recomputes."""
    selective: bool = False
    """(slipstream) Selective recompute: keep the outputs of matrix multiplications and
    attention (without dropout), recompute only the cheap elementwise ops and norms in
    backward."""


class TiledComputeConfig(StrictModel):
    """(slipstream) ``tiled_compute``: sequence tiling of Hugging Face causal LMs (ALST's tiled
    MLP and tiled logits+loss, ``slipstream.sequence.hf_tiling``). DeepSpeed has no config key
    for them (its ALST scripts patch the model by hand with ``TiledMLP`` and
    ``TiledFusedLogitsLoss``, which slipstream also offers under DeepSpeed's names)."""

    mlp: bool = False
    """Run each gated MLP (``gate_proj``/``up_proj``/``down_proj``) over chunks of tokens,
    recomputed in backward: one chunk's ``[tokens, intermediate]`` activations at a time."""
    mlp_shards: int | None = Field(None, ge=1)
    """Chunks per MLP call; null or "auto": ``ceil(tokens / hidden_size)``."""
    logits_loss: bool = False
    """Compute the training loss (a forward with labels) over chunks of tokens without the
    ``[S, vocab]`` logits; such a forward returns ``logits=None``."""
    logits_loss_shards: int | None = Field(None, ge=1)
    """Chunks of the loss; null or "auto": ``ceil(vocab_size / hidden_size)``, at least 64
    tokens per chunk."""


def check_parallel_config(pipe: PipelineConfig) -> None:
    """Cross-field rules of the ``pipeline`` block (run by the loader after parsing)."""
    if pipe.schedule == "interleaved" and pipe.virtual_stages < 2:
        raise ConfigError(
            "config key 'pipeline.virtual_stages' = 1 with schedule 'interleaved': "
            "interleaving needs at least 2 model chunks per rank; set virtual_stages >= 2 "
            "or use schedule '1f1b'"
        )
    if pipe.schedule != "interleaved" and pipe.virtual_stages != 1:
        raise ConfigError(
            f"config key 'pipeline.virtual_stages' = {pipe.virtual_stages} needs schedule "
            f"'interleaved' (got {pipe.schedule!r}): set schedule to 'interleaved' or "
            "virtual_stages to 1"
        )
