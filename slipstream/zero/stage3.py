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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from slipstream.config.zero import ZeroConfig
from slipstream.distributed import comm
from slipstream.distributed.quantize import (
    QuantizedBlocks,
    dequantize_blocks,
    fit_block,
    quantize_blocks,
)
from slipstream.zero.flat import Bucket, _make_bucket
from slipstream.zero.init_shards import InitShards, init_owner
from slipstream.zero.param import (
    EXTERNAL_ATTR,
    INIT_OWNER_ATTR,
    OWNER_ATTR,
    ZeroParamStatus,
    bind_,
    empty_like_released,
    mark_partitioned_,
    release_,
    unmark_,
)

__all__ = [
    "ShardedStore",
    "ZeroPPWeights",
    "set_z3_leaf_modules",
    "shard_params_",
]

_LEAF_ATTR = "_slipstream_z3_leaf"
# Each partitioned parameter carries (store, unit index) under this attribute: tensors must
# not be dict keys here (a lookup may compare them with ==).
_OWNER_ATTR = OWNER_ATTR
_EXTERNAL_ATTR = EXTERNAL_ATTR


def set_z3_leaf_modules(
    model: nn.Module, leaf_classes: Sequence[type[nn.Module]]
) -> list[nn.Module]:
    """Gather every module of these classes (e.g. a mixture-of-experts block) as one unit.

    Call before ``initialize``. Returns the modules marked.
    """
    marked = [m for m in model.modules() if isinstance(m, tuple(leaf_classes))]
    for m in marked:
        setattr(m, _LEAF_ATTR, True)
    return marked


@dataclass
class Unit:
    """A module whose parameters are gathered and released together."""

    index: int
    name: str
    module: nn.Module
    buckets: list[int] = field(default_factory=list)
    uses: list[int] = field(default_factory=list)  # units whose parameters this unit's code reads
    base_uses: set[int] = field(default_factory=set)  # ``uses`` from module registration
    external: set[int] = field(default_factory=set)  # ``uses`` from register_external_parameter
    persistent: bool = False
    gathered: bool = True
    bound: bool = False  # its parameters point at their views (gathered and waited for)
    active: int = 0  # forwards (or GatheredParameters contexts) currently using it
    pending: list[Any] = field(default_factory=list)  # all-gathers in flight (prefetch)
    frozen: list[FrozenInt8] = field(default_factory=list)  # ZeRO++ int8-stored frozen weights


@dataclass
class FrozenInt8:
    """A frozen weight stored as int8 block codes (``zero_quantized_nontrainable_weights``);
    ``buf`` (which the parameter views) holds its dequantized values only while its unit is
    gathered."""

    param: nn.Parameter
    buf: torch.Tensor
    codes: QuantizedBlocks
    empty: torch.Tensor  # what the parameter is while released

    def fill(self) -> None:
        self.buf.untyped_storage().resize_(self.buf.numel() * self.buf.element_size())
        dequantize_blocks(self.codes, out=self.buf)
        bind_(self.param, self.buf.view(self.param.ds_shape))  # type: ignore[attr-defined]

    def free(self) -> None:
        release_(self.param, self.empty)
        self.buf.untyped_storage().resize_(0)

    def nbytes(self) -> int:
        return self.codes.codes.numel() + 4 * self.codes.scales.numel()


def _unit_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    units = [("", model)]
    own = getattr(model, "zero3_units", None)  # a model may name its units (PipelineModule)
    if callable(own):
        units.extend(own())
    for name, mod in model.named_modules():
        if name and getattr(mod, _LEAF_ATTR, False):
            units.append((name, mod))
        if isinstance(mod, nn.ModuleList):
            units.extend((f"{name}.{i}" if name else str(i), child) for i, child in enumerate(mod))
    seen: set[int] = set()
    out = []
    for name, mod in units:
        if id(mod) not in seen:
            seen.add(id(mod))
            out.append((name, mod))
    return out


@dataclass
class ZeroPPWeights:
    """ZeRO++ options of the weight all-gathers (Wang et al. 2023).

    Attributes:
        quantize: qwZ, all-gather int8 block-quantized codes (``zero_quantized_weights``).
        block: elements per quantization block.
        hpz_group: hpZ, the group of ``hpz_size`` consecutive ranks holding a secondary copy
            of each released unit; the backward all-gather stays inside it. None disables.
        hpz_size: size of ``hpz_group``.
        quantize_frozen: store frozen (``requires_grad=False``) weights as int8 codes,
            dequantized per unit while it runs (``zero_quantized_nontrainable_weights``).
    """

    quantize: bool = False
    block: int = 2048
    hpz_group: comm.Group = None
    hpz_size: int = 1
    quantize_frozen: bool = False


class ShardedStore:
    """Parameter placement for stage 3 (the ``ParamStore`` of ``ZeroOptimizer``)."""

    def __init__(self, buckets: list[Bucket], units: list[Unit], dp_group: comm.Group) -> None:
        self.buckets = buckets
        self.units = units
        self.group = dp_group
        self.dp_rank = comm.get_rank(dp_group)
        self.dp_size = comm.get_world_size(dp_group)
        self.partitioned = self.dp_size > 1
        self.unit_of = {b: u.index for u in units for b in u.buckets}
        # What each bucket parameter is while released (its views are ``bucket.views``).
        self.empties = [[empty_like_released(v) for v in b.views] for b in buckets]
        # A bucket of zero.Init parameters has no storage yet: its shard is filled later.
        self.shards = [
            b.flat[b.shard_slice(self.dp_rank)].clone()
            if b.flat.untyped_storage().nbytes()
            else b.flat.new_zeros(b.shard_numel)
            for b in buckets
        ]
        self.materialize_peak_numel = 0  # zero.Init: most elements materialized at once
        self.masters: list[torch.Tensor] | None = None
        self._ready: set[int] = set()
        self.handles: list[Any] = []
        # Unit order of the current and the previous pass, per phase, for prefetching.
        self._order: dict[str, list[int]] = {"fwd": [], "bwd": []}
        self._last: dict[str, list[int]] = {"fwd": [], "bwd": []}
        self._noted: dict[str, set[int]] = {"fwd": set(), "bwd": set()}
        self.prefetch_numel = 50_000_000  # stage3_prefetch_bucket_size (0 disables prefetch)
        self.max_live_numel = 1_000_000_000  # stage3_max_live_parameters (caps prefetching)
        comm.at_exit(self.wait_pending)
        self.zeropp = ZeroPPWeights()
        self.module_unit: dict[int, int] = {}  # id(module) -> index of the unit running it
        self.secondary: list[torch.Tensor | None] = [None] * len(buckets)  # hpZ
        self.secondary_valid = [False] * len(buckets)

    def wait_pending(self) -> None:
        """Finish every all-gather in flight (prefetches of units that never ran)."""
        for unit in self.units:
            for work in unit.pending:
                work.wait()
            unit.pending = []

    def offload_shards(self, device: torch.device, pin_memory: bool) -> None:
        """``offload_param``: keep this rank's parameter shards in host memory; each gather
        copies them to the compute device first."""
        for b, shard in enumerate(self.shards):
            moved = shard.to(device)
            if pin_memory and torch.cuda.is_available():
                moved = moved.pin_memory()
            self.shards[b] = moved
        self.bind_ds_tensors()

    def bind_ds_tensors(self) -> None:
        """Set each parameter's ``ds_tensor``: its part of this rank's shard (maybe empty)."""
        for b, bucket in enumerate(self.buckets):
            lo, hi = self.owned_range(b)
            for p, off, n in zip(bucket.params, bucket.offsets, bucket.numels):
                start, stop = min(max(off, lo), hi), max(min(off + n, hi), lo)
                p.ds_tensor = self.shards[b][start - lo : max(start, stop) - lo]  # type: ignore[attr-defined]

    def enable_zeropp(self, zeropp: ZeroPPWeights, model: nn.Module | None = None) -> None:
        """Turn on qwZ, hpZ and/or int8 frozen weights (before the first forward)."""
        self.zeropp = zeropp
        if zeropp.quantize_frozen and model is not None:
            self._quantize_frozen(model, zeropp.block)
        if zeropp.hpz_group is not None and zeropp.hpz_size > 1:
            for b, bucket in enumerate(self.buckets):
                if self.units[self.unit_of[b]].persistent:
                    continue
                self.secondary[b] = bucket.flat.new_empty(bucket.numel // zeropp.hpz_size)

    @torch.no_grad()
    def _quantize_frozen(self, model: nn.Module, block: int) -> None:
        seen: set[int] = set()
        for _, mod in model.named_modules():
            for p in mod._parameters.values():
                if p is None or p.requires_grad or not p.is_floating_point() or id(p) in seen:
                    continue
                seen.add(id(p))
                unit = self.units[self.module_unit.get(id(mod), 0)]
                n = p.numel()
                codes = quantize_blocks(p.detach(), 8, fit_block(n, block))
                buf = p.detach().new_empty(n)
                mark_partitioned_(p, p.shape, None)
                entry = FrozenInt8(p, buf, codes, empty_like_released(p))
                unit.frozen.append(entry)
                setattr(p, _OWNER_ATTR, (self, unit.index))
                unit.base_uses.add(unit.index)
                unit.uses = sorted(unit.base_uses | unit.external)
                if unit.gathered:
                    entry.fill()
                else:
                    entry.free()
        self.remove_hooks()
        self.install_hooks()

    def frozen_bytes(self) -> int:
        """Bytes of the int8 codes and scales of frozen weights stored quantized."""
        return sum(f.nbytes() for u in self.units for f in u.frozen)

    def secondary_bytes(self) -> int:
        """Memory of the hpZ secondary copies (``2 Psi / G`` in bf16)."""
        return sum(t.numel() * t.element_size() for t in self.secondary if t is not None)

    # ---------------------------------------------------------------- ParamStore API
    def owned_range(self, b: int) -> tuple[int, int]:
        s = self.buckets[b].shard_slice(self.dp_rank)
        return s.start, s.stop

    def owned(self, b: int) -> torch.Tensor:
        return self.shards[b]

    def publish(self, b: int) -> object:
        """After a step: refresh the full storage of units that stay gathered."""
        self.secondary_valid[b] = False  # hpZ: the weights changed
        if not self.units[self.unit_of[b]].gathered:
            return None
        flat = self.buckets[b].flat
        return comm.all_gather_into_tensor(
            flat,
            self.shards[b].to(flat.device, non_blocking=True),
            group=self.group,
            async_op=True,
            label=f"param_unit{b}",
        )

    # ------------------------------------------------------------- gather / release
    def _check_same_unit(self, unit: Unit) -> None:
        if self.dp_size == 1:
            return
        mine = torch.tensor(
            [unit.index],
            dtype=torch.int64,
            device=self.buckets[0].flat.device if self.buckets else "cpu",
        )
        every = mine.new_empty(self.dp_size)
        comm.all_gather_into_tensor(every, mine, group=self.group, label="unit_check")
        if bool((every == unit.index).all()):
            return
        where: dict[str, list[int]] = {}
        for rank, idx in enumerate(every.tolist()):
            label = self.units[idx].name or "<root>" if 0 <= idx < len(self.units) else f"#{idx}"
            where.setdefault(label, []).append(rank)
        detail = "; ".join(f"module '{m}' on dp ranks {r}" for m, r in where.items())
        raise RuntimeError(
            f"ZeRO-3 ranks diverged: they are gathering different modules ({detail}). Every rank "
            "must run the same modules in the same order (same control flow); a module that "
            "only some ranks call must be called on all of them"
        )

    def gather(self, unit: Unit, phase: str = "fwd") -> None:
        """Make ``unit``'s full parameters available (waits for a prefetch in flight)."""
        if not unit.gathered:
            self._start_gather(unit, phase)
        for work in unit.pending:
            work.wait()
        unit.pending = []
        if not unit.bound:
            for b in unit.buckets:
                for p, view in zip(self.buckets[b].params, self.buckets[b].views):
                    bind_(p, view)
            unit.bound = True

    def _start_gather(self, unit: Unit, phase: str = "fwd") -> None:
        self._check_same_unit(unit)
        zpp = self.zeropp
        for b in unit.buckets:
            flat = self.buckets[b].flat
            flat.untyped_storage().resize_(flat.numel() * flat.element_size())
            label = f"param_unit{b}"
            group, source = self.group, self.shards[b]
            secondary = self.secondary[b]
            if phase == "bwd" and secondary is not None and self.secondary_valid[b]:
                group, source = zpp.hpz_group, secondary  # hpZ: stay inside the node
            if source.device != flat.device:  # offload_param: the shard lives on the host
                source = source.to(flat.device, non_blocking=True)
            if zpp.quantize:
                work = comm.all_gather_quantized(
                    flat, source, 8, zpp.block, group=group, async_op=True, label=label
                )
            else:
                work = comm.all_gather_into_tensor(
                    flat, source, group=group, async_op=True, label=label
                )
            unit.pending.append(work)
            for p in self.buckets[b].params:
                p.ds_status = ZeroParamStatus.INFLIGHT  # type: ignore[attr-defined]
        for entry in unit.frozen:
            entry.fill()
        unit.gathered = True

    def _note(self, phase: str, unit: Unit) -> None:
        """Record ``unit`` as the next one ``phase`` needs; prefetch the one after it.

        The order is the one this phase followed in the previous pass (forward and backward
        orders are recorded separately), so a changed control flow only costs a useless
        prefetch; ranks still agree because they all follow their identical last order.
        """
        order, last = self._order[phase], self._last[phase]
        if unit.index in self._noted[phase]:
            return
        self._noted[phase].add(unit.index)
        order.append(unit.index)
        budget = self.prefetch_numel
        for idx in last[len(order) : len(order) + 8]:
            nxt = self.units[idx]
            numel = sum(self.buckets[b].numel for b in nxt.buckets)
            if budget <= 0 or self._live_numel() + numel > self.max_live_numel:
                break
            budget -= numel
            if not nxt.gathered and nxt.buckets:
                self._start_gather(nxt, phase)

    def _live_numel(self) -> int:
        return sum(self.buckets[b].numel for u in self.units if u.gathered for b in u.buckets)

    def release(self, unit: Unit) -> None:
        if not unit.gathered or unit.persistent or unit.active > 0:
            return
        for work in unit.pending:
            work.wait()
        unit.pending = []
        for b in unit.buckets:
            flat = self.buckets[b].flat
            secondary = self.secondary[b]
            filled = flat.untyped_storage().nbytes() > 0  # not a never-filled zero.Init bucket
            if secondary is not None and not self.secondary_valid[b] and filled:
                g = comm.get_rank(self.zeropp.hpz_group)
                n = secondary.numel()
                secondary.copy_(flat[g * n : (g + 1) * n])
                self.secondary_valid[b] = True
            for p, empty in zip(self.buckets[b].params, self.empties[b]):
                release_(p, empty)
            flat.untyped_storage().resize_(0)
        for entry in unit.frozen:
            entry.free()
        unit.gathered = False
        unit.bound = False

    def release_all(self) -> None:
        for unit in self.units:
            self.release(unit)

    # ------------------------------------------------------------------- hooks
    def _pre_forward(self, unit: Unit) -> None:
        if unit.index == 0:  # the root: a new forward begins
            self._new_order("fwd")
        self._note("fwd", unit)
        for u in unit.uses:
            self.units[u].active += 1
            self.gather(self.units[u])

    def _post_forward(self, unit: Unit, output: Any) -> None:
        if torch.is_grad_enabled():
            tensors = [
                t
                for t in tree_flatten(output)[0]
                if isinstance(t, torch.Tensor) and t.requires_grad
            ]
            for t in tensors:
                t.register_hook(lambda grad, unit=unit: self._pre_backward(unit))
        for u in unit.uses:
            self.units[u].active -= 1
            self.release(self.units[u])

    def _pre_backward(self, unit: Unit) -> None:
        self._note("bwd", unit)
        for u in unit.uses:
            self.gather(self.units[u], "bwd")

    def on_bucket_ready(self, b: int) -> None:
        """Reducer callback: bucket ``b`` got all its gradients; free its unit if done."""
        unit = self.units[self.unit_of[b]]
        self._ready.add(b)
        if all(x in self._ready for x in unit.buckets):
            self.release(unit)

    def on_pass_end(self) -> None:
        """Reducer callback at the end of every backward pass."""
        self._ready = set()
        self._new_order("bwd")
        self.release_all()

    def _new_order(self, phase: str) -> None:
        if self._order[phase]:
            self._last[phase] = self._order[phase]
        self._order[phase] = []
        self._noted[phase] = set()

    def install_hooks(self) -> None:
        handles = self.handles
        # state_dict() would hand out views of released storage (reading them crashes the
        # process): refuse with directions instead, unless the parameters are gathered.
        owners = {id(m): m for u in self.units for m in u.module.modules()}
        for mod in owners.values():
            mine = [p for p in mod._parameters.values() if getattr(p, _OWNER_ATTR, None)]
            if mine:
                handles.append(mod.register_state_dict_pre_hook(_refuse_released))
        for unit in self.units:
            if not unit.uses:
                continue
            handles.append(
                unit.module.register_forward_pre_hook(
                    lambda m, a, unit=unit: self._pre_forward(unit)
                )
            )
            handles.append(
                unit.module.register_forward_hook(
                    lambda m, a, out, unit=unit: self._post_forward(unit, out)
                )
            )

    def remove_hooks(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    # ------------------------------------------------------------ gathered access
    @torch.no_grad()
    def set_full(self, unit: Unit, modifier_dp_rank: int | None) -> None:
        """After a ``GatheredParameters`` edit: broadcast the modifier's values into the shards."""
        for b in unit.buckets:
            flat = self.buckets[b].flat
            self._adopt_assigned(b)
            if modifier_dp_rank is not None and self.dp_size > 1:
                src = comm.global_rank(self.group, modifier_dp_rank)
                comm.broadcast(flat, src=src, group=self.group, label="gathered_params")
            self.shards[b].copy_(flat[self.buckets[b].shard_slice(self.dp_rank)])
            if self.masters is not None and self.masters[b] is not self.shards[b]:
                if self.masters[b].numel() != self.shards[b].numel():
                    raise RuntimeError(
                        "GatheredParameters(modifier_rank=...) cannot edit weights whose fp32 "
                        "masters are swapped to NVMe (offload_optimizer.device = 'nvme') yet"
                    )
                self.masters[b].copy_(self.shards[b])
        for entry in unit.frozen:
            _adopt(entry.param, entry.buf.view(entry.param.ds_shape))  # type: ignore[attr-defined]
            if modifier_dp_rank is not None and self.dp_size > 1:
                src = comm.global_rank(self.group, modifier_dp_rank)
                comm.broadcast(entry.buf, src=src, group=self.group, label="gathered_params")
            entry.codes = quantize_blocks(entry.buf, 8, entry.codes.block)

    def _adopt_assigned(self, b: int) -> None:
        bucket = self.buckets[b]
        for p, view in zip(bucket.params, bucket.views):
            _adopt(p, view)


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


def _refuse_released(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    for name, p in module.named_parameters(recurse=False):
        owner = getattr(p, _OWNER_ATTR, None)
        if owner is not None and not owner[0].units[owner[1]].gathered:
            raise RuntimeError(
                f"state_dict() of a ZeRO-3 model while '{prefix}{name}' is partitioned (this rank "
                "holds only its shard). Use engine.save_checkpoint(dir) or "
                "engine.save_16bit_model(dir), or read it inside "
                "`with slipstream.zero.GatheredParameters(list(model.parameters())):` and copy "
                "the tensors (.clone()) before leaving the block"
            )


def shard_params_(
    model: nn.Module,
    groups: Sequence[Sequence[nn.Parameter]],
    names: dict[nn.Parameter, str],
    dp_group: comm.Group,
    cfg: ZeroConfig,
    device: torch.device | None = None,
) -> tuple[list[Bucket], ShardedStore]:
    """Partition ``model``'s trainable parameters per unit, in place; install gather hooks.

    Parameters must already be equal on every rank (broadcast first). Frozen parameters stay
    replicated. Parameters partitioned by ``zero.Init`` are re-laid from their per-parameter
    shards into this rank's bucket shards one parameter at a time (one all-gather each).
    Returns the buckets (in expected gradient order) and the store.
    """
    if device is None:
        device = next((t.device for t in model.buffers() if not t.is_meta), torch.device("cpu"))
        device = next((p.device for p in model.parameters() if not p.is_meta), device)
    dp = comm.get_world_size(dp_group)
    group_of = {p: gi for gi, plist in enumerate(groups) for p in plist}
    unit_mods = _unit_modules(model)
    unit_index = {id(m): i for i, (_, m) in enumerate(unit_mods)}
    owner: dict[nn.Parameter, int] = {}
    uses: list[set[int]] = [set() for _ in unit_mods]
    nearest: dict[int, int] = {}
    for name, mod in model.named_modules():
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        here = unit_index.get(
            id(mod), nearest.get(id(model.get_submodule(parent)), 0) if name else 0
        )
        nearest[id(mod)] = here
        for p in mod._parameters.values():
            if p is None or p not in group_of:
                continue
            owner.setdefault(p, here)
            uses[here].add(owner[p])
    units = [Unit(i, n, m) for i, (n, m) in enumerate(unit_mods)]
    for mod in model.modules():  # register_external_parameter before initialize
        for p in getattr(mod, _EXTERNAL_ATTR, []):
            if p in owner:
                units[nearest[id(mod)]].external.add(owner[p])
    buckets: list[Bucket] = []
    for unit in reversed(units):
        mine = [p for p in owner if owner[p] == unit.index]
        by_key: dict[tuple[int, torch.dtype], list[nn.Parameter]] = {}
        for p in mine:
            by_key.setdefault((group_of[p], p.dtype), []).append(p)
        for (gi, _), plist in by_key.items():
            bucket = _make_bucket(len(buckets), gi, plist, names, dp, device=device)
            unit.buckets.append(bucket.index)
            buckets.append(bucket)
    for unit in units:
        unit.base_uses = {u for u in uses[unit.index] if units[u].buckets}
        unit.external = {u for u in unit.external if units[u].buckets}
        unit.uses = sorted(unit.base_uses | unit.external)
        numel = sum(buckets[b].numel for b in unit.buckets)
        unit.persistent = numel < cfg.stage3_param_persistence_threshold
    store = ShardedStore(buckets, units, dp_group)
    deferred = {b.index for b in buckets if any(init_owner(p) for p in b.params)}
    store.materialize_peak_numel = _take_init_shards(model, store)
    _finish(store, deferred)
    store.module_unit = dict(nearest)
    store.prefetch_numel = cfg.stage3_prefetch_bucket_size
    store.max_live_numel = cfg.stage3_max_live_parameters
    return buckets, store


@torch.no_grad()
def _take_init_shards(model: nn.Module, store: ShardedStore) -> int:
    """Re-lay ``zero.Init`` shards into the store's bucket shards (frozen ones become full
    replicated parameters), one parameter at a time. Returns the most elements held in full
    at once."""
    peak = 0
    owners: set[InitShards] = set()
    for bucket in store.buckets:
        lo, hi = store.owned_range(bucket.index)
        for p, off in zip(bucket.params, bucket.offsets):
            init = init_owner(p)
            if init is None:
                continue
            owners.add(init)
            full = init.full(p)
            peak = max(peak, full.numel())
            start, stop = max(lo, off), min(hi, off + full.numel())
            if start < stop:
                store.shards[bucket.index][start - lo : stop - lo].copy_(
                    full[start - off : stop - off]
                )
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
        p.data = (value.clone() if init.world == 1 else value).view(p.ds_shape)  # type: ignore[attr-defined]
        unmark_(p)
    for init in owners:
        init.drop_guards(model)
    return peak


def _finish(store: ShardedStore, deferred: set[int]) -> None:
    """Mark the parameters, release every unit but the persistent ones (gathered from the
    shards when they came from ``zero.Init``) and install the hooks."""
    for b in store.buckets:
        for p, shape in zip(b.params, b.shapes):
            setattr(p, _OWNER_ATTR, (store, store.unit_of[b.index]))
            mark_partitioned_(p, shape, None)
    store.bind_ds_tensors()
    for unit in store.units:  # eager parameters already point at their (filled) views
        unit.bound = not deferred.intersection(unit.buckets)
    store.release_all()
    for unit in store.units:
        if unit.persistent and not unit.bound:
            unit.gathered = False
            store.gather(unit)
    store.install_hooks()
