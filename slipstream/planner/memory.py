"""Per-rank memory of one training step: model states, activations, communication buffers.

Model states come from slipstream's own ZeRO estimator (:func:`slipstream.zero.estimate_memory`,
Rajbhandari et al. 2020, sec. 3) applied to the parameters one pipeline stage holds after the
tensor-parallel split. Activations follow Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", sec. 4: per layer and micro-batch,

    no recompute, no SP:   s b h (10 + 24/t) + 5 a s^2 b / t   bytes
    with sequence parallel: s b h * 34/t      + 5 a s^2 b / t
    selective recompute:    the 5 a s^2 b / t attention-score term is dropped
    full recompute:         2 s b h (the layer input; / t with SP)

generalized here to grouped-query attention, a gated MLP and models without dropout (the same
bookkeeping, tensor by tensor). The first pipeline stage holds the most micro-batches in flight
(sec. 4.2.3): ``p`` for 1F1B, ``p (1 + (p-1)/(p v))`` for the interleaved schedule, ``m`` for
GPipe; the last stage holds the fp32 logits ``4 s b V / t``.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

import torch
from torch import nn

from slipstream.config.zero import ZeroConfig
from slipstream.planner.layout import Layout
from slipstream.planner.model import ModelSpec
from slipstream.zero.estimate import estimate_memory
from slipstream.zero.prefetch import LOOKAHEAD
from slipstream.zero.reducer import MAX_IN_FLIGHT

__all__ = [
    "PredictedMemory",
    "activation_bytes_per_layer",
    "in_flight_micro_batches",
    "predict_memory",
    "stage_params",
]

# The plan assumes the ZeRO config's defaults; each number is read from where ZeRO keeps it.
_REDUCE_BUCKET: int = ZeroConfig.model_fields["reduce_bucket_size"].default  # elements
_PREFETCH_BUCKET: int = ZeroConfig.model_fields["stage3_prefetch_bucket_size"].default
_PREFETCH_UNITS = LOOKAHEAD  # ZeRO-3 looks this many units ahead
_IN_FLIGHT = MAX_IN_FLIGHT  # gradient buckets reducing at once
_STAGING = _IN_FLIGHT + 1  # gradient staging buckets alive at once


@dataclass(frozen=True)
class PredictedMemory:
    """Predicted bytes on one device of the most loaded pipeline stage (the engine's measured
    counterpart is ``slipstream.runtime.memory_report.MemoryBreakdown``)."""

    stage: str
    """Which stage this is ("first", "last", or "only" without a pipeline)."""
    params: int
    """Working-dtype weights (the ZeRO-3 shard, plus the hpZ copy)."""
    grads: int
    """Gradient accumulation buffers."""
    optimizer: int
    """fp32 master weights and optimizer moments kept on the device."""
    hpz_secondary: int
    """ZeRO++ hpZ secondary weight copy (also counted in ``params``)."""
    activations: int
    """Stored activations of every in-flight micro-batch plus one layer's working set."""
    comm_buffers: int
    """Reduction buckets, ZeRO-3 gathered weights, pipeline send/recv buffers."""
    host: int
    """Bytes offloaded to host memory."""
    nvme: int
    """Bytes offloaded to NVMe."""

    @property
    def total(self) -> int:
        """Device bytes."""
        return self.params + self.grads + self.optimizer + self.activations + self.comm_buffers

    def to_dict(self) -> dict[str, int | str]:
        return {**asdict(self), "total": self.total}


def stage_params(model: ModelSpec, layout: Layout, stage: str) -> int:
    """Parameters one device of ``stage`` holds after the TP split (before ZeRO).

    Matrices and their biases are split ``t`` ways; norms are replicated; the vocabulary is
    split over TP (Megatron's vocab-parallel embedding); learned positions are replicated.
    With tied embeddings and ``pp > 1`` the last stage keeps its own copy of the word
    embedding for the output layer (Shoeybi et al. 2019, sec. 3).
    """
    t = layout.tp
    norms = 2 * (2 * model.hidden if model.bias else model.hidden)
    per_layer = (model.params_per_layer() - norms) // t + norms
    layers = model.layers // layout.pp
    total = layers * per_layer
    words = model.vocab * model.hidden // t
    positions = model.seq * model.hidden if model.learned_positions else 0
    if stage in ("first", "only"):
        total += words + positions
    if stage in ("last", "only"):
        total += model.head_params() - (0 if model.tie_embeddings else model.vocab * model.hidden)
        if not model.tie_embeddings or stage == "last":
            total += words
    return total


def _states(numel: int, layout: Layout) -> dict[str, int]:
    """Model-state bytes of ``numel`` parameters under ZeRO, from the ZeRO estimator."""
    return dict(
        _cached_states(
            numel,
            layout.dp,
            layout.zero_stage,
            layout.grad_bytes,
            layout.hpz_partition_size,
            layout.offload_optimizer,
            layout.offload_param,
            layout.param_bytes,
        )
    )


@functools.lru_cache(maxsize=4096)
def _cached_states(
    numel: int,
    dp: int,
    stage: int,
    grad_bytes: int,
    hpz: int,
    offload_optimizer: str | None,
    offload_param: bool,
    param_bytes: int,
) -> dict[str, int]:
    """A single meta-device parameter of ``numel`` elements stands for the stage's parameters:
    the estimator reads only shapes and dtypes, nothing is allocated. Cached because the
    search asks for the same few sizes thousands of times."""
    holder = nn.Module()
    dtype = torch.float32 if param_bytes == 4 else torch.bfloat16
    holder.weight = nn.Parameter(torch.empty(numel, dtype=dtype, device="meta"))
    return estimate_memory(
        holder,
        world=dp,
        stage=stage,
        grad_dtype=torch.float32 if grad_bytes == 4 else torch.bfloat16,
        hpz_partition_size=hpz,
        offload_optimizer=offload_optimizer,
        offload_param="cpu" if offload_param else None,
    )


def activation_bytes_per_layer(model: ModelSpec, layout: Layout, *, stored: bool = True) -> float:
    """Activation bytes one layer keeps for backward, for one micro-batch (Korthikanti sec. 4).

    ``stored=False`` gives the full set a layer holds while it runs its backward (what a
    recomputed layer rebuilds), whatever the recompute mode. Activations are
    ``layout.param_bytes`` wide (``a``: 2 in bf16/fp16, Korthikanti's case, 4 in fp32).
    """
    s, b, h, t = model.seq, layout.micro_batch, model.hidden, layout.tp
    a = layout.param_bytes
    kv_dim = model.kv * model.head_dim
    drop = 1 if model.dropout else 0
    sp = t if layout.sequence_parallel else 1
    mode = layout.recompute if stored else "none"
    if mode == "full":
        return a * s * b * h / sp
    llama = model.hf_llama_activations
    # Outside the TP region (split by SP): each of the 2 norms keeps its input and its output
    # (the QKV / MLP input), and the two residual dropout masks (1 byte per element): with
    # a = 2, 8h + 2h, Korthikanti's "10". An fp32-computed RMSNorm (HF Llama) keeps its fp32
    # input and the normalized value as well: 4 + a bytes instead of a.
    norm_keeps = 4 + a if llama else a
    replicated = 2 * (norm_keeps + a) * h + 2 * drop * h
    # Inside it: Q, K, V and the output projection's input (Korthikanti's 24h/t with the
    # MLP), and the MLP's inner activations (GELU in + out = 2f; SwiGLU gate, silu(gate), up,
    # product = 4f). HF Llama / the reference GPT repeat K and V to every query head before
    # SDPA (which keeps the repeated ones) and keep SDPA's output besides the contiguous copy
    # the output projection reads.
    kv_kept = h if llama else kv_dim
    attention = h + 2 * kv_kept + h + (h if llama else 0)
    mlp_inner = (4 if model.gated_mlp else 2) * model.ffn
    split = a * (attention + mlp_inner)
    per_token = replicated / sp + split / t
    tokens = s * b
    if model.flash_attention:
        scores = 4.0 * b * (model.heads / t) * s  # fp32 log-sum-exp per query row
    elif mode == "selective":
        scores = 0.0
    else:
        # softmax output (a bytes), dropout mask (1) and output (a): 5 a s^2 b / t in bf16.
        scores = (a + (1 + a) * drop) * (model.heads / t) * s * s * b
    return tokens * per_token + scores


def in_flight_micro_batches(layout: Layout) -> float:
    """Micro-batches whose activations the first stage holds at its peak.

    1F1B: ``min(p, m)``; interleaved: ``p (1 + (p-1)/(p v))`` (Korthikanti sec. 4.2.3, for
    ``m >= p``); GPipe: ``m``; no pipeline: 1.
    """
    p, m, v = layout.pp, layout.micro_batches, layout.virtual_stages
    if p == 1:
        return 1.0
    if layout.gpipe:
        return float(m)
    if v > 1:
        return min(m, p) * (1 + (p - 1) / (p * v))
    return float(min(p, m))


def _activations(model: ModelSpec, layout: Layout, stage: str) -> int:
    """Stored activations of ``stage`` plus the working set of the layer in backward."""
    s, b, h, t = model.seq, layout.micro_batch, model.hidden, layout.tp
    a = layout.param_bytes
    sp = t if layout.sequence_parallel else 1
    layers = model.layers // layout.pp
    per_layer = activation_bytes_per_layer(model, layout)
    in_flight = in_flight_micro_batches(layout) if stage in ("first", "only") else 1.0
    total = layers * per_layer * in_flight
    if layout.recompute != "none":
        # The layer being recomputed holds everything for its own backward.
        total += activation_bytes_per_layer(model, layout, stored=False) - per_layer
    if stage in ("last", "only"):
        # Final norm input and output (the output layer's input), fp32 logits for the
        # cross entropy.
        norm_keeps = 4 + a if model.hf_llama_activations else a
        total += (norm_keeps + a) * s * b * h / sp + 4 * s * b * model.vocab / t
    if stage in ("first", "only") and model.dropout:
        total += s * b * h / sp * in_flight  # embedding dropout mask
    return int(total)


def _comm_buffers(model: ModelSpec, layout: Layout, numel: int, scratch: bool) -> int:
    """Transient buffers, as slipstream's ZeRO allocates them.

    Stages 0/1 reduce the gradient accumulation buffer in place (nothing extra); stage 2
    writes each bucket's gradients into a staging buffer that is reduce-scattered into the
    shard (up to ``_STAGING`` buckets in flight); stage 3 holds the gathered weights of the
    layer in use and of the layers it prefetches (up to the prefetch bucket, at most
    ``_PREFETCH_UNITS`` of them) and stages each layer's gradients the same way; a pipeline
    keeps send/recv buffers. With ``scratch`` (the backend's reduce-scatter copies its
    input, gloo), the two buckets that may reduce at once each keep a scratch copy.
    """
    s, b, h = model.seq, layout.micro_batch, model.hidden
    a = layout.param_bytes
    total = 0
    if layout.dp > 1 and layout.zero_stage == 2:
        total += _grad_staging(_REDUCE_BUCKET, numel, layout.grad_bytes, scratch)
    if layout.zero_stage == 3:
        layer = model.params_per_layer() // layout.tp
        prefetch = min(_PREFETCH_BUCKET, _PREFETCH_UNITS * layer, numel)
        total += (layer + prefetch) * a
        if layout.dp > 1:
            total += _grad_staging(layer, numel, layout.grad_bytes, scratch)
    if layout.pp > 1:
        total += 4 * a * s * b * h * layout.virtual_stages
    return total


def _grad_staging(bucket: int, numel: int, grad_bytes: int, scratch: bool) -> int:
    """Bytes of gradient buckets of ``bucket`` elements staged for reduction: up to
    ``_STAGING`` at once, plus with ``scratch`` a scratch copy of each of the ``_IN_FLIGHT``
    reducing ones; never more than the stage's gradients once (twice with the copies)."""
    buckets = _STAGING + (_IN_FLIGHT if scratch else 0)
    copies = 2 if scratch else 1
    return min(buckets * bucket, copies * numel) * grad_bytes


def _stage_memory(model: ModelSpec, layout: Layout, stage: str, scratch: bool) -> PredictedMemory:
    numel = stage_params(model, layout, stage)
    states = _states(numel, layout)
    device_params = states["params"] - (states["params"] - states["hpz_secondary"]
                                        if layout.offload_param else 0)  # fmt: skip
    on_device_opt = 0 if layout.offload_optimizer else states["master"] + states["optimizer"]
    return PredictedMemory(
        stage=stage,
        params=device_params,
        grads=states["grads"],
        optimizer=on_device_opt,
        hpz_secondary=states["hpz_secondary"],
        activations=_activations(model, layout, stage),
        comm_buffers=_comm_buffers(model, layout, numel, scratch),
        host=states["host"],
        nvme=states["nvme"],
    )


def predict_memory(
    model: ModelSpec, layout: Layout, reduce_scatter_scratch: bool = False
) -> PredictedMemory:
    """Per-device memory of the most loaded stage (first or last; "only" without a pipeline).

    ``reduce_scatter_scratch``: the backend's reduce-scatter keeps a copy of its input
    (``Hardware.reduce_scatter_scratch``: slipstream on gloo)."""
    scratch = reduce_scatter_scratch
    if layout.pp == 1:
        return _stage_memory(model, layout, "only", scratch)
    first = _stage_memory(model, layout, "first", scratch)
    last = _stage_memory(model, layout, "last", scratch)
    return first if first.total >= last.total else last
