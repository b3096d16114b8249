"""Step time of a 3D-parallel + ZeRO layout, with its breakdown.

One micro-batch on the slowest (last) pipeline stage costs

    t_mb = GEMMs / achievable rate  +  elementwise bytes / memory bandwidth
         + TP collectives  +  pipeline point-to-point

and a step is ``(m + (p-1)/v) t_mb`` (the 1F1B bubble ``(p-1)/(v m)`` of Narayanan et al.
2021, sec. 2.2) plus the data-parallel communication that does not hide behind the backward
pass, plus the optimizer. The GEMMs are timed one by one at the hardware profile's rate for
their size. Elementwise kernels (norms, softmax, dropout, GELU, residual adds) are memory
bound: each stored activation byte is taken as written and read once in forward and its
gradient written and read once in backward, 4 bytes of traffic per stored byte.

TP communication (Shoeybi et al. 2019, sec. 3; Korthikanti et al. 2022, sec. 4.2.2) per layer
and micro-batch: 2 all-reduces of ``2 s b h`` bytes in forward and 2 in backward (each is a
reduce-scatter plus an all-gather with sequence parallelism, the same volume), 2 more when a
full recompute repeats the forward, and with sequence parallelism the backward redoes the 2
all-gathers whose outputs it did not keep. These run on the critical path (Megatron does not
overlap them). Pipeline stages exchange ``2 s b h / t`` bytes per device per micro-batch and
direction (the scatter/gather optimization of Narayanan et al. 2021, sec. 4.1), ``v`` times
with ``v`` chunks.

Data parallelism (Rajbhandari et al. 2020): ZeRO-0 all-reduces the gradients once per step,
ZeRO-1/2 reduce-scatter them and all-gather the updated weights, ZeRO-3 gathers weights for
every forward and backward and reduce-scatters gradients every micro-batch (ZeRO++: qwZ halves
the forward gather, hpZ keeps the backward gather inside ``hpz_partition_size`` devices, qgZ
sends a quarter of the gradient bytes; Wang et al. 2023). With ``overlap_comm`` the gradient
reduction hides behind one micro-batch's backward and ZeRO-3's per-micro-batch traffic behind
its compute; only the excess counts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from slipstream.planner.hardware import Hardware
from slipstream.planner.layout import Layout
from slipstream.planner.memory import activation_bytes_per_layer, stage_params
from slipstream.planner.model import ModelSpec
from slipstream.planner.network import CommGroup, collective_time

__all__ = ["ADAM_BYTES_PER_PARAM", "StepTime", "predict_step_time"]

ADAM_BYTES_PER_PARAM = 30
"""Adam's memory traffic per owned parameter: read fp32 master, two moments and the fp32
gradient (16 bytes), write master and moments (12) and the bf16 working copy (2)."""
_TRAFFIC_PER_STORED_BYTE = 4


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step and where they go (per device, slowest stage)."""

    step_time_s: float
    """The whole step."""
    compute_s: float
    """GEMMs of every micro-batch (forward, backward, recompute)."""
    elementwise_s: float
    """Memory-bound kernels of every micro-batch."""
    tp_comm_s: float
    """Tensor-parallel collectives of every micro-batch."""
    pp_comm_s: float
    """Pipeline sends/receives of every micro-batch."""
    bubble_s: float
    """Pipeline fill and drain, ``(p-1)/v`` micro-batch times."""
    dp_comm_s: float
    """Data-parallel/ZeRO communication of the step, hidden or not."""
    dp_exposed_s: float
    """The part of ``dp_comm_s`` that is not hidden behind compute."""
    optimizer_s: float
    """Optimizer update (and offload transfers)."""
    micro_batch_s: float
    """``t_mb``: one micro-batch on the slowest stage."""
    bubble_fraction: float
    """``(p-1)/(v m)``."""

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def _gemm_time(hw: Hardware, flops: float) -> float:
    """One GEMM of ``flops``, at the rate the profile gives for that size."""
    return flops / hw.gemm_rate(flops / 1e9) if flops > 0 else 0.0


def _layer_gemm_flops(model: ModelSpec, layout: Layout) -> list[float]:
    """Forward FLOPs of each GEMM of one layer for one micro-batch on one TP rank."""
    tokens, h, t = model.seq * layout.micro_batch, model.hidden, layout.tp
    kv_dim = model.kv * model.head_dim
    mlp_in = 2.0 * tokens * h * model.ffn / t
    gemms = [
        2.0 * tokens * h * (h + 2 * kv_dim) / t,  # fused QKV
        model.attention_core_flops_per_layer(layout.micro_batch) / t,  # Q K^T and P V
        2.0 * tokens * h * h / t,  # output projection
        mlp_in * (2 if model.gated_mlp else 1),  # fused gate+up (or the first linear)
        mlp_in,  # down projection
    ]
    return gemms


def _stage_compute(model: ModelSpec, hw: Hardware, layout: Layout) -> float:
    """GEMM seconds of one micro-batch on the last stage: its layers forward and backward
    (backward = 2x forward), recompute, and the output layer. The attention core runs at
    the profile's ``attention_efficiency`` of the GEMM rate."""
    gemms = _layer_gemm_flops(model, layout)
    times = [_gemm_time(hw, f) for f in gemms]
    times[1] /= hw.attention_efficiency
    forward = sum(times)
    recompute = {"none": 0.0, "selective": times[1], "full": forward}
    layers = model.layers // layout.pp
    logits = model.logits_forward_flops(layout.micro_batch) / layout.tp
    return layers * (3 * forward + recompute[layout.recompute]) + 3 * _gemm_time(hw, logits)


def _stage_elementwise(model: ModelSpec, hw: Hardware, layout: Layout) -> float:
    """Memory-bound seconds of one micro-batch on one stage (4 bytes of traffic per stored
    activation byte; a recomputed forward adds 2 per recomputed byte)."""
    full = activation_bytes_per_layer(model, layout, stored=False)
    stored = activation_bytes_per_layer(model, layout)
    traffic = _TRAFFIC_PER_STORED_BYTE * full + 2 * (full - stored)
    bandwidth = hw.memory_bandwidth_gbps * 1e9 * hw.memory_efficiency
    return model.layers // layout.pp * traffic / bandwidth


def _tp_group(layout: Layout) -> CommGroup:
    return CommGroup(layout.tp, 1)


def _stage_tp_comm(model: ModelSpec, hw: Hardware, layout: Layout) -> float:
    """Tensor-parallel collective seconds of one micro-batch on one stage."""
    if layout.tp == 1:
        return 0.0
    nbytes = layout.param_bytes * model.seq * layout.micro_batch * model.hidden
    group = _tp_group(layout)
    if layout.sequence_parallel:
        pair = collective_time(hw, "all_gather", nbytes, group) + collective_time(
            hw, "reduce_scatter", nbytes, group
        )
        gather = collective_time(hw, "all_gather", nbytes, group)
        per_layer = 4 * pair + 2 * gather  # fwd 2 pairs, bwd 2 pairs + 2 redone gathers
    else:
        per_layer = 4 * collective_time(hw, "all_reduce", nbytes, group)
    if layout.recompute == "full":
        per_layer *= 1.5  # the recomputed forward repeats its 2 collectives
    return model.layers // layout.pp * per_layer


def _stage_pp_comm(model: ModelSpec, hw: Hardware, layout: Layout) -> float:
    """Pipeline send/receive seconds of one micro-batch on one stage (forward + backward)."""
    if layout.pp == 1:
        return 0.0
    nbytes = layout.param_bytes * model.seq * layout.micro_batch * model.hidden / layout.tp
    group = CommGroup(2, layout.tp * layout.dp)
    return 2 * layout.virtual_stages * collective_time(hw, "p2p", nbytes, group)


def _dp_comm(model: ModelSpec, hw: Hardware, layout: Layout) -> tuple[float, float, float]:
    """Data-parallel / ZeRO seconds per step: (gradient reduction, which may hide behind the
    backward; weight all-gather after the step, which may not; ZeRO-3 traffic per micro-batch,
    which may hide behind that micro-batch's compute)."""
    if layout.dp == 1:
        return 0.0, 0.0, 0.0
    numel = stage_params(model, layout, "last")
    group = CommGroup(layout.dp, layout.tp)
    grad = numel * layout.grad_bytes
    weights = numel * layout.param_bytes
    if layout.zero_stage == 0:
        return collective_time(hw, "all_reduce", grad, group), 0.0, 0.0
    if layout.zero_stage in (1, 2):
        reduce = collective_time(hw, "reduce_scatter", grad, group)
        return reduce, collective_time(hw, "all_gather", weights, group), 0.0
    forward = weights / 2 if layout.quantized_weights else weights
    g = layout.hpz_partition_size
    backward_group = CommGroup(g, layout.tp) if g > 1 else group
    grads = numel * (layout.param_bytes / 4 if layout.quantized_gradients else layout.grad_bytes)
    # Issued layer by layer: each layer's collective pays the latency chain again.
    layers = model.layers // layout.pp
    per_mb = layers * (
        collective_time(hw, "all_gather", forward / layers, group)
        + collective_time(hw, "all_gather", weights / layers, backward_group)
        + collective_time(hw, "reduce_scatter", grads / layers, group)
    )
    return 0.0, 0.0, per_mb


def _optimizer_time(model: ModelSpec, hw: Hardware, layout: Layout) -> float:
    """Adam over this device's shard (memory bound), plus offload transfers over the host
    link (gradients down, updated weights up); the host's own Adam time is not modelled."""
    numel = stage_params(model, layout, "last")
    owned = numel if layout.zero_stage == 0 else numel / layout.dp
    if layout.offload_optimizer:
        return owned * (layout.grad_bytes + layout.param_bytes) / (hw.host_bandwidth_gbps * 1e9)
    bandwidth = hw.memory_bandwidth_gbps * 1e9 * hw.memory_efficiency
    return owned * ADAM_BYTES_PER_PARAM / bandwidth


def predict_step_time(model: ModelSpec, hw: Hardware, layout: Layout) -> StepTime:
    """Step time and breakdown of ``layout`` (already checked with ``check_layout``)."""
    compute = _stage_compute(model, hw, layout)
    elementwise = _stage_elementwise(model, hw, layout)
    tp = _stage_tp_comm(model, hw, layout)
    pp = _stage_pp_comm(model, hw, layout)
    t_mb = compute + elementwise + tp + pp
    m, p, v = layout.micro_batches, layout.pp, layout.virtual_stages
    bubble = (p - 1) / v * t_mb
    reduce, gather, per_mb = _dp_comm(model, hw, layout)
    dp_total = reduce + gather + m * per_mb
    if layout.overlap_comm:
        backward = 2 / 3 * (compute + elementwise)  # backward is about 2/3 of a micro-batch
        exposed = max(0.0, reduce - backward) + gather + m * max(0.0, per_mb - t_mb)
    else:
        exposed = dp_total
    optimizer = _optimizer_time(model, hw, layout)
    return StepTime(
        step_time_s=m * t_mb + bubble + exposed + optimizer,
        compute_s=m * compute,
        elementwise_s=m * elementwise,
        tp_comm_s=m * tp,
        pp_comm_s=m * pp,
        bubble_s=bubble,
        dp_comm_s=dp_total,
        dp_exposed_s=exposed,
        optimizer_s=optimizer,
        micro_batch_s=t_mb,
        bubble_fraction=(p - 1) / (v * m),
    )
