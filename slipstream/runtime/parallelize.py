"""The order in which ``initialize`` parallelizes a model, in one place.

1. Tensor parallelism splits each layer's matrices over the ``tp`` axis (the model-parallel
   RNG streams are seeded first, so dropout in the split regions differs per TP rank while
   the replicated regions stay equal).
2. Sequence parallelism (Ulysses / LSS / ring) binds the attention to the ``sp`` axis
   (ring: its ``sp_ring`` x ``sp_ulysses`` unflattening). After step 1 each TP rank holds
   ``heads / tp`` attention heads, and the sp collectives run on those local heads: the mesh
   order ``(pp, dp_replicate, dp_shard, sp, tp)`` makes each sp group the ranks of one TP
   rank, so Ulysses needs the *local* heads to divide by sp (ring: any count), and a
   vocabulary-parallel loss of step 1 becomes the inner loss of the sequence-parallel mean.
3. Activation checkpointing is configured with the TP group, which partitioned activations
   and the RNG replay need (a Hugging Face model's ``gradient_checkpointing_enable`` layers
   included); tiling (``tiled_compute``: tiled MLP and logits+loss of HF causal LMs) wraps
   the MLPs and the loss, the latter with the ``sp`` group for the global token mean.

The state these steps create belongs to this engine, not to the process: under tensor
parallelism the model-parallel RNG streams live in a tracker of its own (shared by the TP plan
and the recompute), and the recompute options in a ``RecomputeContext`` handed to the model,
so a second engine in the same process neither reseeds nor reconfigures the first.
4. ZeRO comes last (``slipstream.zero.shard_zero_``, called by ``initialize`` once the
   optimizer is planned): it shards whatever parameters the steps above left, so a TP shard
   is ZeRO-sharded again over the data-parallel ranks and never the other way round.

Each step changes the model in place and keeps parameter objects and names.
"""

from __future__ import annotations

import torch
from torch import nn

from slipstream.config import SlipstreamConfig
from slipstream.distributed import comm
from slipstream.distributed.mesh import DeviceMesh, sp_ring_groups
from slipstream.parallel.random import RNGStatesTracker, model_parallel_manual_seed
from slipstream.parallel.recompute import (
    RecomputeContext,
    bind_hf_checkpointing_,
    use_recompute_context_,
)
from slipstream.parallel.tensor import parallelize_tp_
from slipstream.sequence import parallelize_sequence_
from slipstream.sequence.hf import is_hf_attention_model

__all__ = ["axis_group", "parallelize_"]


def axis_group(mesh: DeviceMesh, axis: str) -> comm.Group:
    """The process group of mesh ``axis``, or None when the axis has one rank."""
    return mesh.get_group(axis) if mesh[axis].size() > 1 else None


def parallelize_(model: nn.Module, cfg: SlipstreamConfig, mesh: DeviceMesh) -> None:
    """Apply tensor, sequence and activation-checkpointing parallelism to ``model`` in
    place, in that order (ZeRO follows in ``initialize``)."""
    tp, sp = axis_group(mesh, "tp"), axis_group(mesh, "sp")
    rng_tracker = None  # this engine's TP streams (the process default without TP)
    if tp is not None:
        # Default stream equal on all TP ranks, the sharded-region stream different on each.
        seed = cfg.seed if cfg.seed is not None else torch.initial_seed() % 2**62
        rng_tracker = model_parallel_manual_seed(seed, comm.get_rank(tp), RNGStatesTracker())
        parallelize_tp_(
            model,
            tp,
            sequence_parallel=cfg.tensor_parallel.sequence_parallel,
            rng_tracker=rng_tracker,
        )
    if sp is not None:
        ring_groups, local = None, None
        if cfg.sequence_parallel_mode == "ring":
            ring = cfg.sequence_parallel_ring_size or cfg.sequence_parallel_size
            ring_groups = sp_ring_groups(mesh, ring)
        elif is_hf_attention_model(model):  # packed rows: a ring of one rank (hf.py)
            local = sp_ring_groups(mesh, 1)[1]
        parallelize_sequence_(model, sp, ring_groups, local, tp_size=mesh["tp"].size())
    if (
        mesh["pp"].size() > 1
        or tp is not None
        or cfg.activation_checkpointing != type(cfg.activation_checkpointing)()
    ):
        recompute = RecomputeContext(rng_tracker)
        recompute.configure(tp, cfg.activation_checkpointing)
        use_recompute_context_(model, recompute)
        if is_hf_attention_model(model):
            bind_hf_checkpointing_(model, recompute)
    _tile_(model, cfg, sp)


def _tile_(model: nn.Module, cfg: SlipstreamConfig, sp: comm.Group) -> None:
    """The ``tiled_compute`` switches, for Hugging Face causal LMs only."""
    tiled = cfg.tiled_compute
    if not (tiled.mlp or tiled.logits_loss):
        return
    if not is_hf_attention_model(model):
        raise ValueError(
            f"config key 'tiled_compute' (mlp={tiled.mlp}, logits_loss={tiled.logits_loss}) "
            f"applies to Hugging Face causal LMs; {type(model).__name__} is not one. Set "
            "both to false and call slipstream.sequence.tiling.TiledMLP / "
            "TiledFusedLogitsLoss in your model's forward instead"
        )
    from slipstream.sequence.hf_tiling import tile_hf_loss_, tile_hf_mlp_

    if tiled.mlp:
        tile_hf_mlp_(model, tiled.mlp_shards)
    if tiled.logits_loss:
        tile_hf_loss_(model, tiled.logits_loss_shards, sp)
