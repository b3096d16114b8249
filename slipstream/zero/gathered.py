"""DeepSpeed's ZeRO-3 access API: ``GatheredParameters`` and external parameters.

``GatheredParameters`` works on both kinds of partitioned parameter slipstream makes: those of
a ``zero.Init`` model before ``initialize`` (per-parameter shards,
:mod:`slipstream.zero.init_shards`) and those of a ZeRO-3 engine (per-unit flat buckets,
:mod:`slipstream.zero.stage3`). A parameter another ZeRO-3 implementation partitioned is
refused with an error naming it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from slipstream.distributed import comm
from slipstream.distributed.quantize import quantize_blocks
from slipstream.zero.init import deferred_init_active, partition_pending
from slipstream.zero.init_shards import InitShards, init_owner
from slipstream.zero.param import EXTERNAL_ATTR, bind_, foreign_partition_error, is_zero_param
from slipstream.zero.sharded_store import ShardedStore, unit_owner
from slipstream.zero.units import Unit

__all__ = [
    "GatheredParameters",
    "forward_gathered",
    "register_external_parameter",
    "unregister_external_parameter",
]

_EXTERNAL_ATTR = EXTERNAL_ATTR


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Declare that ``module``'s forward reads ``parameter``, which another module owns
    (DeepSpeed's API): ZeRO-3 then gathers it whenever ``module`` runs. Call it before or
    after ``initialize``."""
    if not isinstance(parameter, nn.Parameter):
        raise TypeError(
            f"register_external_parameter({type(module).__name__}, ...) needs an "
            f"nn.Parameter, got {type(parameter).__name__}"
        )
    external: list[nn.Parameter] = module.__dict__.setdefault(_EXTERNAL_ATTR, [])
    if not any(q is parameter for q in external):
        external.append(parameter)
    _update_external(module, parameter, add=True)


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Undo :func:`register_external_parameter`."""
    external: list[nn.Parameter] = module.__dict__.get(_EXTERNAL_ATTR, [])
    module.__dict__[_EXTERNAL_ATTR] = [q for q in external if q is not parameter]
    _update_external(module, parameter, add=False)


def _update_external(module: nn.Module, parameter: nn.Parameter, add: bool) -> None:
    """After ``initialize``: add or drop the owner unit in the unit running ``module``."""
    owner = unit_owner(parameter)
    if owner is None:
        return  # not partitioned yet: shard_params_ reads the module's list
    store, idx = owner.store, owner.unit.index
    where = store.module_unit.get(id(module))
    if where is None:
        raise ValueError(
            f"register_external_parameter: {type(module).__name__} is not part of the model "
            "whose parameter was passed: register the parameter on a module of that model"
        )
    unit = store.units[where]
    if add:
        unit.external.add(idx)
    elif not any(
        (o := unit_owner(q)) is not None and o.unit.index == idx
        for q in module.__dict__.get(_EXTERNAL_ATTR, [])
    ):
        unit.external.discard(idx)
    unit.update_uses()
    store.remove_hooks()
    store.install_hooks()


def _partition_owners(
    plist: list[Any],
) -> tuple[list[tuple[ShardedStore, Unit]], dict[int, tuple[InitShards, list[nn.Parameter]]]]:
    """Group ``plist`` by what manages each parameter: store units and ``zero.Init`` shards.
    Raises for a parameter another ZeRO-3 implementation partitioned."""
    if deferred_init_active() and any(isinstance(p, torch.Tensor) and p.is_meta for p in plist):
        partition_pending()  # inside an open zero.Init: partition what was built so far
    units: dict[tuple[int, int], tuple[ShardedStore, Unit]] = {}
    inits: dict[int, tuple[InitShards, list[nn.Parameter]]] = {}
    for i, p in enumerate(plist):
        if not isinstance(p, nn.Parameter):
            continue  # DeepSpeed ignores what is not a parameter
        owner = unit_owner(p)
        init = init_owner(p)
        if owner is not None:
            units[(id(owner.store), owner.unit.index)] = (owner.store, owner.unit)
        elif init is not None:
            group = inits.setdefault(id(init), (init, []))[1]
            if not any(q is p for q in group):
                group.append(p)
        elif is_zero_param(p):
            raise foreign_partition_error(f"#{i} of the GatheredParameters list", p)
    for _, group in inits.values():
        group.sort(key=lambda q: int(q.ds_id))  # type: ignore[attr-defined]  # same order on every rank
    return [units[k] for k in sorted(units, key=lambda k: k[1])], inits


@contextmanager
def GatheredParameters(
    params: nn.Parameter | Sequence[nn.Parameter] | None,
    modifier_rank: int | None = None,
    fwd_module: nn.Module | None = None,
    enabled: bool = True,
) -> Iterator[None]:
    """Give temporary full access to ZeRO-3 partitioned parameters (DeepSpeed's API).

    Every data-parallel rank must enter it with the same parameters. With ``modifier_rank``,
    edits made on that rank (in place, or by assigning ``p.data``) are broadcast to all ranks
    and kept in the shards; without it they are discarded when the block ends. Works on
    parameters built under ``zero.Init`` before ``initialize`` too. Parameters that are not
    partitioned pass through unchanged; ``fwd_module`` registers the parameters as external
    parameters of that module (see :func:`register_external_parameter`).
    """
    if params is None or not enabled:
        yield
        return
    plist = [params] if isinstance(params, torch.Tensor) else list(params)
    if fwd_module is not None:
        for p in plist:
            if isinstance(p, nn.Parameter):
                register_external_parameter(fwd_module, p)
    units, inits = _partition_owners(plist)
    for store, unit in units:
        store.gather(unit)
        unit.active += 1
    for init, group in inits.values():
        init.gather(group)
    try:
        yield
    finally:
        for init, group in inits.values():
            init.release(group, modifier_rank)
        for store, unit in units:
            unit.active -= 1
            if modifier_rank is not None:
                _keep_edits(store, unit, modifier_rank)
            store.release(unit, hand_off=True)


@contextmanager
def forward_gathered(params: Sequence[nn.Parameter]) -> Iterator[None]:
    """Gather the ZeRO-3 units holding ``params`` for a forward that runs their modules
    without their units' own forward (the paged decoding engine's per-block forward), as
    ZeRO-3's forward hooks do: the modules inside run without gathering again, and the full
    storage is freed in place when the block ends (no new storage, unlike
    :func:`GatheredParameters`, whose callers may keep the tensors). Every rank of the
    data-parallel group must enter it with the same units, in the same order. Parameters
    that are not unit-partitioned pass through."""
    units: dict[tuple[int, int], tuple[ShardedStore, Unit]] = {}
    for p in params:
        owner = unit_owner(p)
        if owner is not None:
            units[(id(owner.store), owner.unit.index)] = (owner.store, owner.unit)
    held = [units[k] for k in sorted(units, key=lambda k: k[1])]
    for store, unit in held:
        store.gather(unit)
        unit.active += 1
    try:
        yield
    finally:
        for store, unit in held:
            unit.active -= 1
            store.release(unit)


@torch.no_grad()
def _keep_edits(store: ShardedStore, unit: Unit, modifier_dp_rank: int) -> None:
    """End of a ``GatheredParameters(modifier_rank=...)`` block: broadcast the modifier's
    values of ``unit`` and keep them in every rank's shards (and masters)."""
    edp_ranks: list[int] | None = None
    for b in unit.buckets:
        bucket = store.buckets[b]
        for p, view in zip(bucket.params, bucket.views):
            _adopt(p, view)
        group, src_rank = store.group, modifier_dp_rank
        if bucket.expert is not None:
            # MoE experts: each expert-data-parallel group takes the values from its member
            # in the modifier's place (the other groups hold other experts).
            group = bucket.expert.edp_group
            if edp_ranks is None:
                edp_ranks = comm.all_gather_object(comm.get_rank(group), group=store.group)
            src_rank = edp_ranks[modifier_dp_rank]
        if comm.get_world_size(group) > 1:
            src = comm.global_rank(group, src_rank)
            comm.broadcast(bucket.flat, src=src, group=group, label="gathered_params")
        shard = store.shards[b]
        shard.copy_(bucket.flat[bucket.shard_slice(comm.get_rank(group))])
        masters = store.masters
        if masters is not None and masters[b] is not shard:
            if masters[b].numel() != shard.numel():
                raise RuntimeError(
                    "GatheredParameters(modifier_rank=...) cannot edit weights whose fp32 "
                    "masters are swapped to NVMe (offload_optimizer.device = 'nvme') yet"
                )
            masters[b].copy_(shard)
    for entry in unit.frozen:
        _adopt(entry.param, entry.buf.view(entry.param.ds_shape))  # type: ignore[attr-defined]
        if store.dp_size > 1:
            src = comm.global_rank(store.group, modifier_dp_rank)
            comm.broadcast(entry.buf, src=src, group=store.group, label="gathered_params")
        entry.codes = quantize_blocks(entry.buf, 8, entry.codes.block)


@torch.no_grad()
def _adopt(p: nn.Parameter, view: torch.Tensor) -> None:
    """Inside ``GatheredParameters`` a user may assign ``p.data = t`` instead of editing in
    place (as ``load_state_dict(assign=True)`` does): copy ``t`` into ``p``'s bucket view."""
    data = p.data
    if data.data_ptr() == view.data_ptr() and data.shape == view.shape:
        return
    if data.shape != view.shape:
        raise ValueError(
            f"GatheredParameters: a parameter of shape {tuple(view.shape)} was given a value of "
            f"shape {tuple(data.shape)} inside the block: assign (or copy_) a tensor of the "
            "parameter's shape"
        )
    view.copy_(data)
    bind_(p, view)
