"""ZeRO-3 units: which modules' parameters are gathered and released together.

The model is cut into *units*: the root module, every child of an ``nn.ModuleList`` (a
transformer block), every module marked a leaf with :func:`set_z3_leaf_modules` and whatever a
model names itself through a ``zero3_units()`` hook (``PipelineModule``). Each trainable
parameter belongs to the nearest unit enclosing the first module that registers it; its
unit's buckets (one per optimizer param group and dtype) hold it. A unit *uses* the units
whose parameters its own code reads (a tied weight registered in two places, and parameters
declared with ``register_external_parameter``), and gathers them whenever it runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from slipstream.distributed import comm
from slipstream.distributed.expert import ExpertGroups
from slipstream.zero.flat import Bucket, expert_of, make_bucket
from slipstream.zero.leaf_modules import (
    get_z3_leaf_modules,
    set_z3_leaf_modules,
    unset_z3_leaf_modules,
    z3_leaf_module,
)
from slipstream.zero.param import EXTERNAL_ATTR
from slipstream.zero.zeropp import FrozenInt8

__all__ = [
    "Unit",
    "UnitPlan",
    "get_z3_leaf_modules",
    "plan_units",
    "set_z3_leaf_modules",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
]


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

    def update_uses(self) -> None:
        """Recompute ``uses`` after ``base_uses`` or ``external`` changed."""
        self.uses = sorted(self.base_uses | self.external)


@dataclass
class UnitPlan:
    """The units of a model and the buckets that hold their trainable parameters.

    Attributes:
        units: in ``named_modules`` order, the root first.
        buckets: in expected gradient order (the last unit's buckets first).
        module_unit: ``id(module)`` -> index of the unit that runs the module.
    """

    units: list[Unit]
    buckets: list[Bucket]
    module_unit: dict[int, int]


def unit_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every unit of ``model``, each once, the root first."""
    units = [("", model)]
    own = getattr(model, "zero3_units", None)  # a model may name its units (PipelineModule)
    if callable(own):
        units.extend(own())
    for name, mod in model.named_modules():
        if name and z3_leaf_module(mod):
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


def plan_units(
    model: nn.Module,
    groups: Sequence[Sequence[nn.Parameter]],
    names: dict[nn.Parameter, str],
    dp_size: int,
    device: torch.device,
    persistence_threshold: int,
    experts: dict[str, ExpertGroups] | None = None,
) -> UnitPlan:
    """Cut ``model`` into units and lay each unit's trainable parameters (those in ``groups``,
    the optimizer's param groups) out in flat buckets on ``device``; parameters become views.

    Units with fewer than ``persistence_threshold`` elements are marked persistent (they stay
    gathered). ``zero.Init`` parameters get buckets without storage (filled later). MoE expert
    parameters of an ``ep_size`` > 1 (``experts``, by expert group name) get buckets of their
    own, padded to and later sharded over their expert-data-parallel group.
    """
    group_of = {p: gi for gi, plist in enumerate(groups) for p in plist}
    mods = unit_modules(model)
    unit_index = {id(m): i for i, (_, m) in enumerate(mods)}
    owner: dict[nn.Parameter, int] = {}
    uses: list[set[int]] = [set() for _ in mods]
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
    units = [Unit(i, n, m) for i, (n, m) in enumerate(mods)]
    for mod in model.modules():  # register_external_parameter before initialize
        for p in getattr(mod, EXTERNAL_ATTR, []):
            if p in owner:
                units[nearest[id(mod)]].external.add(owner[p])
    buckets: list[Bucket] = []
    for unit in reversed(units):
        mine = [p for p in owner if owner[p] == unit.index]
        by_key: dict[tuple[int, torch.dtype, str], list[nn.Parameter]] = {}
        expert: dict[str, ExpertGroups] = {}
        for p in mine:
            g = expert_of(p, experts) if experts is not None else None
            name = "" if g is None else p.group_name  # type: ignore[attr-defined]
            if g is not None:
                expert[name] = g
            by_key.setdefault((group_of[p], p.dtype, name), []).append(p)
        for (gi, _, name), plist in by_key.items():
            g = expert.get(name)
            size = dp_size if g is None else comm.get_world_size(g.edp_group)
            bucket = make_bucket(len(buckets), gi, plist, names, size, device=device)
            bucket.expert = g
            unit.buckets.append(bucket.index)
            buckets.append(bucket)
    for unit in units:
        unit.base_uses = {u for u in uses[unit.index] if units[u].buckets}
        unit.external = {u for u in unit.external if units[u].buckets}
        unit.update_uses()
        numel = sum(buckets[b].numel for b in unit.buckets)
        unit.persistent = numel < persistence_threshold
    return UnitPlan(units, buckets, dict(nearest))
