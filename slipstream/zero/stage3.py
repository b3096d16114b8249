"""ZeRO stage 3: parameters partitioned too, gathered per module just in time.

Rajbhandari et al. 2020, section 5.3. The model is cut into *units*: the root module, every
child of an ``nn.ModuleList`` (a transformer block) and every module marked a leaf with
``set_z3_leaf_modules``. Each unit's trainable parameters are flat buckets (one per optimizer
param group and dtype) whose full storage exists only while the unit runs: a forward pre-hook
all-gathers it, the forward post-hook frees it (``untyped_storage().resize_(0)``, so tensors
autograd saved keep their identity and see the data again when it is re-gathered), a hook on
the unit's outputs gathers it again for backward, and it is freed once all of its gradients
have been reduce-scattered. Between uses each rank holds only its 1/N shard.

What users see of a released parameter is DeepSpeed's contract (:mod:`slipstream.zero.param`):
an empty tensor (``numel() == 0``) with the real shape in ``ds_shape``, so any access is safe.
Gathering points ``param.data`` at its view of the bucket and releasing points it at an empty
placeholder; ``.data`` assignment keeps the parameter's identity, so the parameter autograd
saved in forward sees its values again in backward, and views of it autograd saved keep the
bucket's storage, which ``resize_`` refills.

Units smaller than ``stage3_param_persistence_threshold`` elements stay gathered (their
updated shards are all-gathered after each step), as in DeepSpeed. While a unit runs, the
units that followed it in the previous pass (forward and backward orders are recorded
separately) are prefetched, up to ``stage3_prefetch_bucket_size`` elements (0 disables it)
and never beyond ``stage3_max_live_parameters`` gathered elements.

Before every gather the ranks exchange the unit's index: ranks that run different modules
(different control flow) get an error naming the modules and ranks instead of a hang.

Where each job lives: :mod:`.units` cuts the model into units and lays out their buckets,
:mod:`.sharded_store` gathers and releases them (hooks, offload, the ``ParamStore`` API),
:mod:`.prefetch` records the order to prefetch in, :mod:`.zeropp` holds the ZeRO++ weight
features (qwZ, hpZ, int8 frozen weights). This module puts them together
(:func:`shard_params_`) and re-lays ``zero.Init`` shards into the store.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from slipstream.distributed import comm
from slipstream.distributed.expert import ExpertGroups
from slipstream.zero._deepspeed_classes import DeepSpeedZeroOptimizer_Stage3
from slipstream.zero.flat import Bucket
from slipstream.zero.init_shards import InitShards, init_owner
from slipstream.zero.param import INIT_OWNER_ATTR, mark_partitioned_, unmark_
from slipstream.zero.policies import Stage3Options
from slipstream.zero.sharded_store import ShardedStore, UnitOwner, unit_owner
from slipstream.zero.units import Unit, plan_units, set_z3_leaf_modules
from slipstream.zero.zeropp import ZeroPPWeights

__all__ = [
    "DeepSpeedZeroOptimizer_Stage3",
    "ShardedStore",
    "Stage3Options",
    "Unit",
    "UnitOwner",
    "ZeroPPWeights",
    "set_z3_leaf_modules",
    "shard_params_",
    "unit_owner",
]


def shard_params_(
    model: nn.Module,
    groups: Sequence[Sequence[nn.Parameter]],
    names: dict[nn.Parameter, str],
    dp_group: comm.Group,
    options: Stage3Options,
    device: torch.device | None = None,
    experts: dict[str, ExpertGroups] | None = None,
) -> ShardedStore:
    """Partition ``model``'s trainable parameters per unit, in place; install gather hooks.

    Parameters must already be equal on every rank (broadcast first). Frozen parameters stay
    replicated (or int8-stored, with ``options.weights.quantize_frozen``). Parameters
    partitioned by ``zero.Init`` are re-laid from their per-parameter shards into this rank's
    bucket shards one parameter at a time (one all-gather each). Returns the store; its
    ``buckets`` are in expected gradient order. MoE expert parameters of an ``ep_size`` > 1
    (``experts``) are sharded over their expert-data-parallel group instead: each rank holds
    its own experts, which the other expert-parallel ranks do not have.
    """
    if device is None:
        device = next((t.device for t in model.buffers() if not t.is_meta), torch.device("cpu"))
        device = next((p.device for p in model.parameters() if not p.is_meta), device)
    dp = comm.get_world_size(dp_group)
    plan = plan_units(model, groups, names, dp, device, options.persistence_threshold, experts)
    _refuse_expert_init(plan.buckets, options)
    store = ShardedStore(plan.buckets, plan.units, dp_group, options, plan.module_unit)
    deferred = {b.index for b in plan.buckets if any(init_owner(p) for p in b.params)}
    store.materialize_peak_numel = _take_init_shards(model, store)
    _finish(store, deferred, model)
    return store


def _refuse_expert_init(buckets: Sequence[Bucket], options: Stage3Options) -> None:
    """Expert buckets (``ep_size`` > 1) hold different experts on each expert-parallel rank:
    ``zero.Init`` shards (cut over the whole world) and hpZ's secondary copies (cut over a
    node) would mix them."""
    for b in buckets:
        if b.expert is None:
            continue
        if any(init_owner(p) for p in b.params):
            raise ValueError(
                f"MoE expert parameters of ep_size {b.expert.ep_size} built under zero.Init "
                f"({b.names[:2]}...) are not supported: build the MoE model outside "
                "deepspeed.zero.Init (ZeRO stage 3 still partitions it), or use ep_size 1"
            )
        if options.weights.hpz:
            raise ValueError(
                f"zero_optimization.zero_hpz_partition_size = {options.weights.hpz_size} with "
                f"MoE expert parallelism (ep_size {b.expert.ep_size}) is not supported: set "
                "zero_hpz_partition_size to 1, or ep_size to 1"
            )


@torch.no_grad()
def _take_init_shards(model: nn.Module, store: ShardedStore) -> int:
    """Re-lay ``zero.Init`` shards into the store's bucket shards (frozen ones become full
    replicated parameters), one parameter at a time. Returns the most elements held in full
    at once."""
    peak = 0
    owners: set[InitShards] = set()
    for bucket in store.buckets:
        lo, hi = store.owned_range(bucket.index)
        for i, p in enumerate(bucket.params):
            init = init_owner(p)
            if init is None:
                continue
            owners.add(init)
            full = init.full(p)  # collective: every rank, even one without a part of it
            peak = max(peak, full.numel())
            mine = bucket.param_slice(i, lo, hi)
            if mine:
                store.shards[bucket.index][mine.at(lo)].copy_(full[mine.param])
            delattr(p, INIT_OWNER_ATTR)
    seen: set[int] = set()
    for p in model.parameters():
        init = init_owner(p)
        if init is None or id(p) in seen:
            continue
        seen.add(id(p))
        owners.add(init)
        value = init.full(p)
        peak = max(peak, value.numel())
        if value.dtype != p.dtype:  # initialize cast the placeholder to the training dtype
            value = value.to(p.dtype)
        elif init.world == 1:
            value = value.clone()
        p.data = value.view(p.ds_shape)  # type: ignore[attr-defined]
        unmark_(p)
    for init in owners:
        init.drop_guards(model)
    return peak


def _finish(store: ShardedStore, deferred: set[int], model: nn.Module) -> None:
    """Mark the parameters, release every unit but the persistent ones (gathered from the
    shards when they came from ``zero.Init``), then activate the store (ZeRO++ weights,
    hooks)."""
    for b in store.buckets:
        unit = store.units[store.unit_of[b.index]]
        for p, shape in zip(b.params, b.shapes):
            store.own_(p, unit)
            mark_partitioned_(p, shape, None)
    store.bind_ds_tensors()
    for unit in store.units:  # eager parameters already point at their (filled) views
        unit.bound = not deferred.intersection(unit.buckets)
    store.release_all()
    for unit in store.units:
        if unit.persistent:  # gathered for good: AVAILABLE, as DeepSpeed reports them
            if not unit.bound:
                unit.gathered = False
            unit.bound = False
            store.gather(unit)
    store.activate(model)
