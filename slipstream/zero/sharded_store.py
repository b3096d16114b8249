"""``ShardedStore``: where ZeRO-3 parameters live, and the gathering and releasing of units.

Each rank keeps its 1/N shard of every unit's buckets (an MoE expert bucket: its 1/N shard
over the expert-data-parallel group, whose ranks hold the same experts). A unit's full storage exists only
while it is gathered: a forward pre-hook all-gathers it (waiting for a prefetch in flight),
the forward post-hook frees it (``untyped_storage().resize_(0)``, so tensors autograd saved
keep their identity and see the data again when it is re-gathered), a hook on the unit's
outputs gathers it again for backward, and the reducer's callback frees it once all of its
gradients are reduced. Gathering points ``param.data`` at its view of the bucket and releasing
points it at an empty placeholder (:mod:`slipstream.zero.param`). Persistent units stay
gathered; ``publish`` refreshes them after each step.

Before every gather the ranks exchange the unit's index: ranks that run different modules
(different control flow) get an error naming the modules and ranks instead of a hang.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from slipstream._logging import logger
from slipstream.accelerator import get_accelerator
from slipstream.distributed import comm, quantized_comm
from slipstream.distributed.quantize import fit_block, quantize_blocks
from slipstream.zero.flat import Bucket, Waitable
from slipstream.zero.param import (
    EXTERNAL_ATTR,
    OWNER_ATTR,
    ZeroParamStatus,
    bind_,
    empty_like_released,
    mark_partitioned_,
    release_,
)
from slipstream.zero.policies import Stage3Options
from slipstream.zero.prefetch import Phase, UnitOrder
from slipstream.zero.units import Unit
from slipstream.zero.zeropp import FrozenInt8, SecondaryShards

__all__ = ["ShardedStore", "UnitOwner", "unit_owner"]


@dataclass(frozen=True)
class UnitOwner:
    """What manages a ZeRO-3 parameter: a store and the unit of it the parameter is in."""

    store: ShardedStore
    unit: Unit


def unit_owner(p: torch.Tensor) -> UnitOwner | None:
    """The store and unit that gather ``p``, or None when ZeRO-3 does not partition it."""
    owner = p.__dict__.get(OWNER_ATTR)
    return owner if isinstance(owner, UnitOwner) else None


class ShardedStore:
    """Parameter placement for stage 3 (the ``ParamStore`` of ``ZeroOptimizer``).

    Args:
        buckets: every unit's buckets (``UnitPlan.buckets``).
        units: the units (``UnitPlan.units``).
        dp_group: data-parallel group the shards are cut over.
        options: prefetch budgets, offload and ZeRO++ options.
        module_unit: ``id(module)`` -> index of the unit running it.
    """

    def __init__(
        self,
        buckets: list[Bucket],
        units: list[Unit],
        dp_group: comm.Group,
        options: Stage3Options,
        module_unit: dict[int, int],
    ) -> None:
        self.buckets = buckets
        self.units = units
        self.group = dp_group
        self.options = options
        self.zeropp = options.weights
        self.module_unit = module_unit
        self.dp_rank = comm.get_rank(dp_group)
        self.dp_size = comm.get_world_size(dp_group)
        self.partitioned = self.dp_size > 1
        self.unit_of = {b: u.index for u in units for b in u.buckets}
        # What each bucket parameter is while released (its views are ``bucket.views``).
        self.empties = [[empty_like_released(v) for v in b.views] for b in buckets]
        # A bucket of zero.Init parameters has no storage yet: its shard is filled later.
        self.shards = [self._place(self._first_shard(b)) for b in buckets]
        self.materialize_peak_numel = 0  # zero.Init: most elements materialized at once
        self.masters: list[torch.Tensor] | None = None
        self._ready: set[int] = set()
        self.handles: list[Any] = []
        self.order = UnitOrder()
        self.secondary: SecondaryShards | None = None  # hpZ, from activate()
        comm.at_exit(self._finish_at_exit)

    def _first_shard(self, b: Bucket) -> torch.Tensor:
        if b.flat.untyped_storage().nbytes():
            return b.flat[b.shard_slice(self._rank(b))].clone()
        return b.flat.new_zeros(b.shard_numel)

    def _rank(self, b: Bucket) -> int:
        """This rank's shard of ``b``: its data-parallel rank, or its rank in the
        expert-data-parallel group for an MoE expert bucket."""
        return self.dp_rank if b.expert is None else comm.get_rank(b.expert.edp_group)

    def _place(self, shard: torch.Tensor) -> torch.Tensor:
        """``offload_param``: move a shard to its home in host memory."""
        device = self.options.offload_device
        if device is None:
            return shard
        moved = shard.to(device)
        if self.options.pin_memory:
            moved = get_accelerator().pin_memory(moved)  # a no-op on a CPU-only machine
        return moved

    def activate(self, model: nn.Module) -> None:
        """Last step of sharding, once the shards hold their values and the units are
        released: int8-store frozen weights, allocate hpZ copies, install the hooks."""
        if self.zeropp.quantize_frozen:
            self._quantize_frozen(model, self.zeropp.block)
        if self.zeropp.hpz:
            persistent = {b for u in self.units if u.persistent for b in u.buckets}
            self.secondary = SecondaryShards(
                self.buckets, persistent, self.zeropp.hpz_group, self.zeropp.hpz_size
            )
        self.install_hooks()

    def _finish_at_exit(self, deadline: float | None) -> None:
        """At exit: finish the all-gathers in flight, each until ``deadline`` at most (a peer
        that neither takes part nor exits must not hold this process forever)."""
        for unit in self.units:
            for b, work in zip(unit.buckets, unit.pending):
                what = f"the all-gather of parameter unit {unit.index} ('param_unit{b}')"
                comm.wait_at_exit(work, what, deadline)
            unit.pending = []

    def own_(self, p: nn.Parameter, unit: Unit) -> None:
        """Record that ``unit`` of this store gathers ``p``."""
        p.__dict__[OWNER_ATTR] = UnitOwner(self, unit)

    def bind_ds_tensors(self) -> None:
        """Set each parameter's ``ds_tensor``: its part of this rank's shard (maybe empty)."""
        for b, bucket in enumerate(self.buckets):
            lo, hi = self.owned_range(b)
            for i, p in enumerate(bucket.params):
                p.ds_tensor = self.shards[b][bucket.param_slice(i, lo, hi).at(lo)]  # type: ignore[attr-defined]

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
                self.own_(p, unit)
                unit.base_uses.add(unit.index)
                unit.update_uses()
                if unit.gathered:
                    entry.fill()
                else:
                    entry.free()

    def frozen_bytes(self) -> int:
        """Bytes of the int8 codes and scales of frozen weights stored quantized."""
        return sum(f.nbytes() for u in self.units for f in u.frozen)

    def secondary_bytes(self) -> int:
        """Memory of the hpZ secondary copies (``2 Psi / G`` in bf16)."""
        return 0 if self.secondary is None else self.secondary.nbytes()

    # ---------------------------------------------------------------- ParamStore API
    def held_range(self, b: int) -> tuple[int, int]:
        return self.owned_range(b)

    def held(self, b: int) -> torch.Tensor:
        return self.shards[b]

    def owned_range(self, b: int) -> tuple[int, int]:
        s = self.buckets[b].shard_slice(self._rank(self.buckets[b]))
        return s.start, s.stop

    def owned(self, b: int) -> torch.Tensor:
        return self.shards[b]

    def publish(self, b: int) -> Waitable | None:
        """After a step: refresh the full storage of units that stay gathered."""
        if self.secondary is not None:
            self.secondary.invalidate(b)  # hpZ: the weights changed
        if not self.units[self.unit_of[b]].gathered:
            return None
        flat = self.buckets[b].flat
        return comm.all_gather_into_tensor(
            flat,
            self.shards[b].to(flat.device, non_blocking=True),
            group=self.buckets[b].comm_group(self.group),
            async_op=True,
            label=f"param_unit{b}",
        )

    def refresh(self) -> None:
        """After the shards were overwritten (a checkpoint load): re-gather the units that
        stay gathered and drop the stale hpZ copies."""
        works = [self.publish(b) for b in range(len(self.buckets))]
        for work in works:
            if work is not None:
                work.wait()

    def attach_masters(self, masters: list[torch.Tensor]) -> None:
        """``GatheredParameters(modifier_rank=...)`` edits reach these masters too."""
        self.masters = masters

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

    def gather(self, unit: Unit, phase: Phase = "fwd") -> None:
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

    def _start_gather(self, unit: Unit, phase: Phase = "fwd") -> None:
        self._check_same_unit(unit)
        zpp = self.zeropp
        for b in unit.buckets:
            flat = self.buckets[b].flat
            flat.untyped_storage().resize_(flat.numel() * flat.element_size())
            label = f"param_unit{b}"
            group, source = self.buckets[b].comm_group(self.group), self.shards[b]
            secondary = self.secondary.source(b) if self.secondary is not None else None
            if phase == "bwd" and secondary is not None:
                group, source = zpp.hpz_group, secondary  # hpZ: stay inside the node
            if source.device != flat.device:  # offload_param: the shard lives on the host
                source = source.to(flat.device, non_blocking=True)
            if zpp.quantize:
                work = quantized_comm.all_gather_quantized(
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

    def _prefetch_after(self, phase: Phase, unit: Unit) -> None:
        """Record ``unit`` as the next one ``phase`` needs; start gathering the units that
        followed it last time, within the prefetch and live-element budgets."""
        budget = self.options.prefetch_numel
        for idx in self.order.note(phase, unit.index):
            nxt = self.units[idx]
            numel = sum(self.buckets[b].numel for b in nxt.buckets)
            if budget <= 0 or self._live_numel() + numel > self.options.max_live_numel:
                break
            budget -= numel
            if not nxt.gathered and nxt.buckets:
                self._start_gather(nxt, phase)

    def _live_numel(self) -> int:
        return sum(self.buckets[b].numel for u in self.units if u.gathered for b in u.buckets)

    def release(self, unit: Unit, hand_off: bool = False) -> None:
        """Free ``unit``'s full storage. In place (``resize_(0)``) by default, so tensors
        autograd saved keep their identity and see the values again at the next gather. With
        ``hand_off`` (the end of a ``GatheredParameters`` block), or when the storage cannot be
        resized (a NumPy array pins it), the bucket gets new storage instead and tensors the
        user took keep the values they had."""
        if not unit.gathered or unit.persistent or unit.active > 0:
            return
        for work in unit.pending:
            work.wait()
        unit.pending = []
        for b in unit.buckets:
            flat = self.buckets[b].flat
            filled = flat.untyped_storage().nbytes() > 0  # not a never-filled zero.Init bucket
            if self.secondary is not None and filled:
                self.secondary.keep(b, flat)
            for p, empty in zip(self.buckets[b].params, self.empties[b]):
                release_(p, empty)
            if hand_off or not flat.untyped_storage().resizable():
                self.buckets[b].renew_storage()
            else:
                flat.untyped_storage().resize_(0)
        for entry in unit.frozen:
            entry.free(hand_off)
        unit.gathered = False
        unit.bound = False

    def release_all(self) -> None:
        for unit in self.units:
            self.release(unit)

    # ------------------------------------------------------------------- hooks
    def _pre_forward(self, unit: Unit) -> None:
        if unit.index == 0:  # the root: a new forward begins
            self.order.new_pass("fwd")
        self._prefetch_after("fwd", unit)
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
        recompute = _in_backward()
        for u in unit.uses:
            self.units[u].active -= 1
            if not recompute:
                self.release(self.units[u])

    def _pre_backward(self, unit: Unit) -> None:
        self._prefetch_after("bwd", unit)
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
        self.order.new_pass("bwd")
        self.release_all()

    # A module inside a unit can run without its unit's forward: a model method other than
    # ``forward`` calls submodules directly (DeepSpeed-Chat's ``reward_model.forward_value``
    # calls ``self.rwtransformer(...)`` and ``self.v_head(...)``). DeepSpeed gathers each
    # module's own parameters whenever that module runs, whatever called it; here such a
    # module gathers the units its parameters are in for the length of its forward (and
    # again for its backward). Inside its unit's forward the units are already held and the
    # hooks only count.
    def _pre_inner(self, mod: nn.Module, uses: list[int]) -> None:
        held = [self.units[u] for u in uses if self.units[u].active == 0]
        self._inner_held.setdefault(id(mod), []).append(held)
        for unit in held:
            unit.active += 1
            self.gather(unit)

    def _post_inner(self, mod: nn.Module, output: Any) -> None:
        stack = self._inner_held.get(id(mod))
        if not stack:
            return
        held = stack.pop()
        if not held:
            return
        if torch.is_grad_enabled():
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda grad, held=held: self._gather_for_backward(held))
        recompute = _in_backward()
        for unit in held:
            unit.active -= 1
            if not recompute:
                self.release(unit)

    def _gather_for_backward(self, units: list[Unit]) -> None:
        for unit in units:
            self.gather(unit, "bwd")

    def _inner_modules(self) -> list[tuple[nn.Module, list[int]]]:
        """Each module inside a unit (not a unit itself) whose subtree, short of other
        units, holds parameters this store gathers; with the units those are in."""
        unit_mods = {id(u.module) for u in self.units}
        out: dict[int, tuple[nn.Module, list[int]]] = {}

        def walk(mod: nn.Module) -> set[int]:
            mine = {
                o.unit.index
                for p in [*mod._parameters.values(), *getattr(mod, EXTERNAL_ATTR, [])]
                if p is not None and (o := unit_owner(p)) is not None and o.store is self
            }
            for child in mod.children():
                if id(child) not in unit_mods:
                    mine |= walk(child)
            if mine and id(mod) not in unit_mods:
                out[id(mod)] = (mod, sorted(mine))
            return mine

        for unit in self.units:
            walk(unit.module)
        return list(out.values())

    def install_hooks(self) -> None:
        handles = self.handles
        self._inner_held: dict[int, list[list[Unit]]] = {}
        for mod, uses in self._inner_modules():
            handles.append(
                mod.register_forward_pre_hook(lambda m, a, uses=uses: self._pre_inner(m, uses))
            )
            handles.append(
                mod.register_forward_hook(
                    lambda m, a, out: self._post_inner(m, out), always_call=True
                )
            )
        # state_dict() hands out the released placeholders (empty), as DeepSpeed's does: warn
        # with directions, unless the parameters are gathered.
        owners = {id(m): m for u in self.units for m in u.module.modules()}
        for mod in owners.values():
            if any(unit_owner(p) for p in mod._parameters.values() if p is not None):
                handles.append(mod.register_state_dict_pre_hook(_warn_released))
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


def _in_backward() -> bool:
    """A forward running inside a backward pass: an activation-checkpoint recompute (HF's
    non-reentrant ``torch.utils.checkpoint`` recomputes a layer when its saved tensors are
    first unpacked). Its saved tensors are views of the gathered storage that the layer's
    backward reads next, so the unit stays gathered until its gradients are reduced
    (``on_bucket_ready``) instead of being released when the recomputed forward returns."""
    return bool(torch._C._current_graph_task_id() != -1)


def _warn_released(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    """DeepSpeed's ``state_dict()`` of a ZeRO-3 model: released parameters come out as their
    empty placeholders (0 elements; DeepSpeed-Chat saves such a dict on rank 0 and then
    overwrites it with gathered values). Say so once per process, with what to call."""
    global _WARNED_STATE_DICT
    if _WARNED_STATE_DICT:
        return
    for name, p in module.named_parameters(recurse=False):
        owner = unit_owner(p)
        if owner is not None and not owner.unit.gathered:
            _WARNED_STATE_DICT = True
            logger.warning(
                "state_dict() of a ZeRO-3 model while '%s%s' is partitioned: as in DeepSpeed, "
                "partitioned parameters come out empty (0 elements). For their values use "
                "engine.save_16bit_model(dir) or engine.save_checkpoint(dir), or read the "
                "state dict inside `with deepspeed.zero.GatheredParameters(list(model."
                "parameters())):` and .clone() the tensors before leaving the block",
                prefix,
                name,
            )
            return


_WARNED_STATE_DICT = False
