"""``deepspeed.checkpointing``: activation checkpointing under DeepSpeed's import path.

The implementation is ``slipstream.parallel.recompute`` (recomputation, not saving: saving and
loading training state is ``slipstream.checkpoint``). This module only re-exports its names.
"""

from slipstream.parallel.recompute import (
    checkpoint,
    configure,
    get_cuda_rng_tracker,
    is_configured,
    model_parallel_cuda_manual_seed,
    non_reentrant_checkpoint,
    reset,
    set_num_layers,
)

__all__ = [
    "checkpoint",
    "configure",
    "get_cuda_rng_tracker",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "non_reentrant_checkpoint",
    "reset",
    "set_num_layers",
]
