"""``shard_zero_``: apply ZeRO stage 0, 1, 2 or 3 to a model in place.

Two paths lay the parameters out: stages 0-2 put every trainable parameter in flat buckets of
``reduce_bucket_size`` elements that every rank holds in full (:class:`FlatStore`); stage 3
cuts the model into units whose buckets each rank holds a shard of, gathered just in time
(:class:`ShardedStore`). Both then get the same gradient reducer and optimizer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from slipstream._logging import log_rank0
from slipstream.config import ConfigError
from slipstream.config.zero import ZeroConfig
from slipstream.distributed import comm
from slipstream.distributed.expert import ExpertGroups
from slipstream.distributed.topology import NodeTopology, build_node_topology
from slipstream.precision import PrecisionPolicy
from slipstream.zero.flat import Bucket, FlatStore, ParamStore, build_buckets, expert_of
from slipstream.zero.init import is_partitioned_model, partition_ordinary_, unpartition_
from slipstream.zero.optimizer import ZeroOptimizer
from slipstream.zero.param import is_zero_param
from slipstream.zero.policies import Stage3Options, StepPolicy, ZeroPPWeights
from slipstream.zero.reducer import GradientListener, GradientReducer, ReducePolicy
from slipstream.zero.stage3 import shard_params_

__all__ = ["shard_zero_"]


@dataclass
class _Layout:
    """What a sharding path hands to the common tail of ``shard_zero_``."""

    buckets: list[Bucket]
    store: ParamStore
    listener: GradientListener | None = None  # told when buckets' gradients are in
    two_hop: tuple[comm.Group, comm.Group] | None = None  # qgZ groups


def shard_zero_(
    model: nn.Module,
    dp_group: comm.Group,
    cfg: ZeroConfig,
    precision: PrecisionPolicy,
    param_groups: Sequence[dict[str, Any]],
    make_optimizer: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
    step: StepPolicy,
    device: torch.device | None = None,
    experts: dict[str, ExpertGroups] | None = None,
) -> ZeroOptimizer:
    """Apply ZeRO stage 0, 1, 2 or 3 to ``model`` in place and return its optimizer.

    Parameters keep their names and modules; each becomes a view into a flat bucket.
    Parameters are broadcast from data-parallel rank 0 so all replicas start equal.

    Args:
        model: the module (already on its device and in the compute dtype).
        dp_group: data-parallel process group.
        cfg: ``zero_optimization`` config (stage, bucket sizes, overlap).
        precision: dtypes of parameters, master weights, accumulation and reduction.
        param_groups: optimizer param groups (dicts with ``params`` and hyperparameters).
        make_optimizer: builds the inner optimizer on the master tensors.
        step: loss scaling, clipping and overflow policy.
        device: where parameters built under ``zero.Init`` are laid out (default: where the
            model's buffers are, else CPU).
        experts: MoE expert-parallel groups by expert group name (from
            ``slipstream.moe.expert_parallel_``): expert parameters of an ``ep_size`` > 1
            are bucketed apart, broadcast, reduced and sharded over their
            expert-data-parallel group (stages 0-3).
    Communication: stage 0/1 one all-reduce of all gradients per optimizer step; stage 2
    one reduce-scatter per micro-step; stage 1/2 one all-gather of the parameters per step;
    stage 3 an all-gather per unit in forward and in backward, a reduce-scatter per bucket.
    """
    names = {p: n for n, p in model.named_parameters()}
    groups = _param_groups(model, param_groups)
    trainable = {p for g in groups for p in g}
    orphans = [n for p, n in names.items() if p.requires_grad and p not in trainable]
    if orphans:
        log_rank0("parameters not in any optimizer param group are not trained: %s", orphans[:8])
    if not step.gradient_average and experts is not None:
        raise ConfigError(
            "config key 'gradient_allreduce_op' = 'sum' is not supported with MoE expert layers "
            "(their gradients are averaged over the expert-data-parallel ranks): use 'mean'"
        )
    if cfg.stage == 3:
        layout = _shard_units(model, groups, names, dp_group, cfg, device, experts)
    else:
        layout = _shard_flat(model, groups, names, dp_group, cfg, experts)
    dp_size = comm.get_world_size(dp_group)
    policy = ReducePolicy(
        partition_grads=cfg.stage >= 2 and dp_size > 1,
        accum_dtype=precision.grad_accum_dtype,
        reduce_dtype=precision.reduce_dtype,
        overlap=cfg.overlap,
        predivide_factor=step.predivide_factor if step.prescale_gradients else 1.0,
        ignore_unused=cfg.ignore_unused_parameters,
        two_hop=layout.two_hop,
        grad_block=cfg.zero_quantized_gradients_block_size,
        average=step.gradient_average,
    )
    reducer = GradientReducer(
        layout.buckets, dp_group, policy, shard_grads=cfg.stage >= 1, listener=layout.listener
    )
    hparams = [{k: v for k, v in g.items() if k != "params"} for g in param_groups]
    return ZeroOptimizer(
        layout.buckets,
        reducer,
        make_optimizer,
        hparams,
        dp_group,
        layout.store,
        master_dtype=precision.master_dtype,
        step=step,
    )


def _shard_flat(
    model: nn.Module,
    groups: list[list[nn.Parameter]],
    names: dict[nn.Parameter, str],
    dp_group: comm.Group,
    cfg: ZeroConfig,
    experts: dict[str, ExpertGroups] | None = None,
) -> _Layout:
    """Stages 0-2: every rank holds all parameters in flat buckets; stages 1/2 update one
    shard of each bucket per rank and all-gather the updates."""
    if is_partitioned_model(model):
        unpartition_(model)  # zero.Init model without stage 3: every rank holds it all anyway
    dp_size = comm.get_world_size(dp_group)
    buckets = build_buckets(groups, names, cfg.reduce_bucket_size, dp_size, experts)
    _broadcast_from_dp0(model, buckets, dp_group)
    return _Layout(buckets, FlatStore(buckets, dp_group, partitioned=cfg.stage >= 1))


def _shard_units(
    model: nn.Module,
    groups: list[list[nn.Parameter]],
    names: dict[nn.Parameter, str],
    dp_group: comm.Group,
    cfg: ZeroConfig,
    device: torch.device | None,
    experts: dict[str, ExpertGroups] | None = None,
) -> _Layout:
    """Stage 3: each rank holds a shard of every unit's buckets; units are gathered while they
    run (ZeRO++ qwZ/hpZ/qgZ as configured). MoE expert buckets are sharded over their
    expert-data-parallel group."""
    topology = None
    if cfg.zero_quantized_gradients or cfg.zero_hpz_partition_size > 1:
        topology = build_node_topology(
            cfg.zero_hpz_partition_size if cfg.zero_hpz_partition_size > 1 else None
        )
    _broadcast_from_dp0(model, [], dp_group)
    _broadcast_experts(model, experts)
    late = partition_ordinary_(model)  # made outside zero.Init after the rest was
    if late:
        log_rank0(
            "ZeRO-3: partitioned %d parameters made outside zero.Init: %s", len(late), late[:8]
        )
    options = _stage3_options(cfg, topology)
    store = shard_params_(model, groups, names, dp_group, options, device, experts)
    return _Layout(store.buckets, store, store, _two_hop(cfg, topology, dp_group))


def _stage3_options(cfg: ZeroConfig, topology: NodeTopology | None) -> Stage3Options:
    hpz = topology is not None and cfg.zero_hpz_partition_size > 1
    offload = cfg.offload_param is not None and cfg.offload_param.enabled
    return Stage3Options(
        prefetch_numel=cfg.stage3_prefetch_bucket_size,
        max_live_numel=cfg.stage3_max_live_parameters,
        persistence_threshold=cfg.stage3_param_persistence_threshold,
        offload_device=torch.device("cpu") if offload else None,
        pin_memory=offload and cfg.offload_param is not None and cfg.offload_param.pin_memory,
        weights=ZeroPPWeights(
            quantize=cfg.zero_quantized_weights,
            block=cfg.zero_quantized_weights_block_size,
            hpz_group=topology.node_group if hpz and topology is not None else None,
            hpz_size=cfg.zero_hpz_partition_size,
            quantize_frozen=cfg.zero_quantized_nontrainable_weights,
        ),
    )


def _param_groups(model: nn.Module, groups: Sequence[dict[str, Any]]) -> list[list[nn.Parameter]]:
    names = {p: n for n, p in model.named_parameters()}
    seen: set[nn.Parameter] = set()
    out: list[list[nn.Parameter]] = []
    for gi, group in enumerate(groups):
        plist = []
        for p in group["params"]:
            if p not in names:
                raise ValueError(
                    f"optimizer param group {gi} holds a tensor of shape {tuple(p.shape)} that is "
                    "not a parameter of the model passed to initialize(): build the optimizer "
                    "from model.parameters()"
                )
            if p in seen:
                raise ValueError(f"parameter '{names[p]}' appears in more than one param group")
            seen.add(p)
            if p.requires_grad:
                plist.append(p)
        out.append(plist)
    return out


@torch.no_grad()
def _broadcast_experts(model: nn.Module, experts: dict[str, ExpertGroups] | None) -> None:
    """Stage 3: MoE expert parameters of an ``ep_size`` > 1 are equal only over their
    expert-data-parallel group; start them from its first rank."""
    for p in model.parameters():
        g = expert_of(p, experts) if not p.is_meta and not is_zero_param(p) else None
        if g is not None and comm.get_world_size(g.edp_group) > 1:
            first = comm.global_rank(g.edp_group, 0)
            comm.broadcast(p.data, src=first, group=g.edp_group, label="init_params")


def _two_hop(
    cfg: ZeroConfig, topology: NodeTopology | None, dp_group: comm.Group
) -> tuple[comm.Group, comm.Group] | None:
    """qgZ groups, or None when qgZ is off (or pointless: a single node)."""
    if not cfg.zero_quantized_gradients or topology is None:
        return None
    if comm.get_world_size(dp_group) != comm.get_world_size():
        raise ValueError(
            "zero_quantized_gradients (qgZ) needs the data-parallel group to be the whole "
            "world (no tensor/pipeline/sequence parallelism yet): disable qgZ"
        )
    if topology.num_nodes == 1:
        log_rank0("zero_quantized_gradients: one node only, so qgZ is off (nothing to save)")
        return None
    if cfg.zero_hpz_partition_size > 1 and topology.ranks_per_node != cfg.zero_hpz_partition_size:
        raise ValueError(
            f"zero_hpz_partition_size = {cfg.zero_hpz_partition_size} differs from the ranks "
            f"per node ({topology.ranks_per_node}) that qgZ uses: set it to "
            f"{topology.ranks_per_node}"
        )
    return (topology.node_group, topology.cross_group)


@torch.no_grad()
def _broadcast_from_dp0(model: nn.Module, buckets: Sequence[Bucket], dp_group: comm.Group) -> None:
    if comm.get_world_size(dp_group) == 1:
        return
    src = comm.global_rank(dp_group, 0)
    for b in buckets:
        # Expert buckets hold this rank's own experts: equal only over their edp group.
        group = b.comm_group(dp_group)
        if comm.get_world_size(group) > 1:
            first = comm.global_rank(group, 0)
            comm.broadcast(b.flat, src=first, group=group, label="init_params")
    in_buckets = {id(p) for b in buckets for p in b.params}
    for t in [p for p in model.parameters() if id(p) not in in_buckets] + list(model.buffers()):
        if t.is_meta or is_zero_param(t):
            continue  # zero.Init: partitioned identically on every rank
        if getattr(t, "allreduce", True) is False:
            continue  # a frozen MoE expert: each expert-parallel rank holds different ones
        if t.is_floating_point() or t.dtype in (torch.int64, torch.int32):
            comm.broadcast(t.data, src=src, group=dp_group, label="init_params")
