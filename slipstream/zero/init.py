"""Sharded construction for ZeRO-3: ``zero.Init`` and the materializer behind it.

Inside ``with slipstream.zero.Init():`` every parameter a module registers is first replaced
by a meta tensor of the same shape, dtype and ``requires_grad`` (buffers stay real: they are
small and often computed in ``__init__``), so building the model costs no parameter memory.
When the outermost context exits (or earlier, the first time ``GatheredParameters`` touches one
of them inside it) the models built inside are *partitioned*, one module at a time
(``materialize_``): each module's own parameters are allocated in full and initialized, this
rank's equal slice is kept as the parameter's shard (``p.ds_tensor``) and the full tensor is
freed. From then on every parameter is a real sharded tensor with DeepSpeed's contract
(:mod:`slipstream.zero.param`: an empty tensor plus ``ds_shape``/``ds_numel``/``ds_status``),
so ``GatheredParameters(..., modifier_rank=r)`` edits and ``load_state_dict`` inside it land in
the shards, before and after ``initialize``. Peak extra memory is the largest module's own
parameters, never the model. All ranks draw the same random numbers (rank 0's RNG state, as
captured when the first parameter was created, is used by every rank), so partitioning needs
no communication of weights and the values do not depend on the world size.

``torch.distributed``: like DeepSpeed, ``Init`` initializes it (``comm.init_distributed``) when
the process was started by a launcher (``RANK`` is set) and it is not yet. Without a launcher
and without a process group it runs as a world of one (each shard is the whole parameter) and
creates no group.

How a module is initialized, first match wins:

1. ``init_module_weights(name, module)`` of the nearest enclosing model that has it
   (slipstream's reference models), or its ``_init_weights(module)`` (Hugging Face
   ``PreTrainedModel``);
2. ``module.reset_parameters()`` (every ``torch.nn`` layer with parameters).

For a model whose eager ``__init__`` runs the same per-module initializer in ``named_modules``
order from the same RNG state (``slipstream.models.GPT`` does), the weights equal eager
construction bit for bit; so do those of a model made only of layers with
``reset_parameters`` (plain torch), initialized in the order they were built, as eager
construction does. Otherwise they are drawn from the same initializers in a different
order: same distributions, not the same numbers.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)

from slipstream.accelerator import get_accelerator
from slipstream.distributed import comm
from slipstream.zero.init_shards import InitShards, init_owner
from slipstream.zero.param import full_shape, unmark_

__all__ = [
    "Init",
    "deferred_init_active",
    "has_meta_parameters",
    "is_partitioned_model",
    "materialize_",
    "partition_meta_",
    "partition_ordinary_",
    "partition_pending",
    "set_data_",
    "unpartition_",
]

_STATE = threading.local()
_RNG_ATTR = "_slipstream_init_rng"  # RNG state captured at Init entry, kept on the root model
# When a module first registered a parameter under Init: eager construction initializes plain
# torch layers in that order (each one's reset_parameters ends its own __init__).
_ORDER_ATTR = "_slipstream_init_order"
_BUILD_COUNTER = itertools.count()


def deferred_init_active() -> bool:
    """True inside ``zero.Init()``: models should not materialize their parameters."""
    return bool(getattr(_STATE, "depth", 0))


def has_meta_parameters(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def is_partitioned_model(model: nn.Module) -> bool:
    """True if some parameter is still meta or holds only a ``zero.Init`` shard."""
    return any(p.is_meta or init_owner(p) is not None for p in model.parameters())


class Init:
    """Build a model without allocating its parameters; stage 3 shards them at ``initialize``.

    DeepSpeed's ``deepspeed.zero.Init`` as a context manager::

        with slipstream.zero.Init():
            model = GPT(GPTConfig.preset("gpt-small"))
        engine, *_ = slipstream.initialize(model=model, config=cfg)  # stage 3

    Args:
        enabled: ``False`` makes the context a no-op (DeepSpeed's flag).
        dtype: create the parameters in this dtype instead of the one the module asks for.
        config_dict_or_path: optional config; if given its ZeRO stage must be 3.
        remote_device, pin_memory, module, data_parallel_group, mpu: accepted for
            DeepSpeed compatibility; any non-default value raises ``NotImplementedError``
            naming the argument (parameter offload is not implemented yet, and the
            data-parallel group is the engine's).
    """

    def __init__(
        self,
        module: nn.Module | None = None,
        data_parallel_group: Any = None,
        mem_efficient_linear: bool = True,
        remote_device: str | None = None,
        pin_memory: bool = False,
        config_dict_or_path: Any = None,
        config: Any = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu: Any = None,
    ) -> None:
        unsupported = {
            "module": module is not None,
            "data_parallel_group": data_parallel_group is not None,
            "remote_device": remote_device not in (None, "none"),
            "pin_memory": pin_memory,
            "mpu": mpu is not None,
        }
        # enabled=False is a no-op context, whatever else is passed (Lightning's
        # DeepSpeedStrategy enters zero.Init(enabled=stage == 3, config_dict_or_path=its
        # stage-2 config) around configure_model at every stage).
        bad = [k for k, v in unsupported.items() if v and enabled]
        if bad:
            raise NotImplementedError(
                f"zero.Init({bad[0]}=...) is not supported: build the model inside the "
                "context and pass it to slipstream.initialize (which shards it over the "
                "engine's data-parallel group); parameter offload (remote_device) is not "
                "implemented yet"
            )
        del mem_efficient_linear  # a DeepSpeed memory trick for Linear; ours needs none
        source = config_dict_or_path if config_dict_or_path is not None else config
        if source is not None and enabled:
            from slipstream.config.loader import load_config

            raw = source.model_dump() if hasattr(source, "model_dump") else load_config(source)
            stage = (raw.get("zero_optimization") or {}).get("stage", 0)
            if stage != 3:
                raise ValueError(
                    f"zero.Init is for ZeRO stage 3 but the config has zero_optimization.stage "
                    f"= {stage}: set stage 3, or build the model without zero.Init"
                )
        self.enabled = enabled
        self.dtype = dtype
        self.peak_numel = 0  # most parameter elements alive at once while partitioning
        self._handles: list[Any] = []

    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        if not comm.is_initialized() and "RANK" in os.environ:
            comm.init_distributed()  # DeepSpeed's Init does the same under a launcher
        _STATE.depth = getattr(_STATE, "depth", 0) + 1
        if _STATE.depth == 1:
            _STATE.rng = None  # captured at the first parameter: seeding inside is fine
            _STATE.built = {}  # id -> module registering a parameter or child, in order
            _STATE.peak = 0
        self._handles = [
            register_module_parameter_registration_hook(self._to_meta),  # type: ignore[arg-type]
            register_module_module_registration_hook(self._track_child),  # type: ignore[arg-type]
        ]
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if not self.enabled:
            return
        for handle in self._handles:
            handle.remove()
        try:
            # As DeepSpeed, a model built in a nested Init is partitioned (has ds_id) when
            # that Init exits. Everything pending is partitioned then, in build order, so the
            # initial values follow the RNG stream of the construction order.
            if exc_type is None:
                partition_pending()
        finally:  # leave the context even when partitioning raised
            if _STATE.depth == 1:
                self.peak_numel = _STATE.peak
                _STATE.built = {}
            _STATE.depth -= 1

    @staticmethod
    def _track_child(module: nn.Module, name: str, child: Any) -> None:
        _STATE.built.setdefault(id(module), module)

    def _to_meta(self, module: nn.Module, name: str, param: Any) -> nn.Parameter | None:
        if param is None:
            return None
        _STATE.built.setdefault(id(module), module)
        # Remember the RNG state on every module built here; the root is among them.
        if _STATE.rng is None:
            _STATE.rng = _capture_rng()
        if not hasattr(module, _RNG_ATTR):
            object.__setattr__(module, _RNG_ATTR, _STATE.rng)
        if not hasattr(module, _ORDER_ATTR):
            object.__setattr__(module, _ORDER_ATTR, next(_BUILD_COUNTER))
        if init_owner(param) is not None:
            return None  # already partitioned (registered again, e.g. tied after a flush)
        dtype = self.dtype if self.dtype is not None and param.is_floating_point() else param.dtype
        if param.is_meta and param.dtype == dtype:
            return None  # already deferred (e.g. a tied weight registered twice): keep identity
        meta = nn.Parameter(
            torch.empty(param.shape, dtype=dtype, device="meta"),
            requires_grad=param.requires_grad,
        )
        meta.__dict__.update(param.__dict__)
        return meta


def set_data_(param: nn.Parameter, data: torch.Tensor) -> None:
    """``param.data = data``, also from the meta device (keeps the Python object, and so
    optimizer param groups and tied references, valid)."""
    if param.is_meta and not data.is_meta:
        # Swap in a fresh tensor of the right device first, then set_data: the parameter must
        # not share ``data``'s version counter (ZeRO-3 writes its flat buffer in place).
        attrs = dict(param.__dict__)
        fresh = nn.Parameter(data.new_empty(0), requires_grad=param.requires_grad)
        torch.utils.swap_tensors(param, fresh)
        param.__dict__.update(attrs)
    param.data = data


def _capture_rng() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    acc = get_accelerator()
    if acc.device_name() != "cpu":
        state[acc.device_name()] = acc.get_rng_state()
    return state


@contextmanager
def _replayed_rng(state: dict[str, Any] | None) -> Iterator[None]:
    acc = get_accelerator()
    on_device = acc.device_name() != "cpu"
    devices = [acc.current_device()] if on_device else []
    with torch.random.fork_rng(devices=devices, device_type=acc.device_name()):
        if state is not None:
            torch.set_rng_state(state["cpu"])
            if on_device and acc.device_name() in state:
                acc.set_rng_state(state[acc.device_name()])
        yield


def _initializers(
    modules: list[tuple[str, nn.Module]],
) -> dict[int, Callable[[], None]]:
    """For each module, how to initialize its own parameters: the nearest enclosing model
    (itself included) that defines ``init_module_weights`` or ``_init_weights``, else the
    module's ``reset_parameters``."""
    owner: dict[str, tuple[nn.Module, str]] = {}  # module name -> (model, its name)
    out: dict[int, Callable[[], None]] = {}
    for name, mod in modules:
        if _has_model_initializer(mod):
            owner[name] = (mod, name)
        else:
            parent = name.rsplit(".", 1)[0] if "." in name else ""
            if name and parent in owner:
                owner[name] = owner[parent]
        if name in owner:
            model, base = owner[name]
            rel = name[len(base) + 1 :] if base else name
            per_module = getattr(model, "init_module_weights", None)
            if callable(per_module):
                out[id(mod)] = functools.partial(per_module, rel, mod)
            else:
                out[id(mod)] = functools.partial(getattr(model, "_init_weights"), mod)  # noqa: B009
            continue
        reset = getattr(mod, "reset_parameters", None)
        if callable(reset):
            out[id(mod)] = reset
    return out


def _has_model_initializer(module: nn.Module) -> bool:
    return callable(getattr(module, "init_module_weights", None)) or callable(
        getattr(module, "_init_weights", None)
    )


def _no_initializer(name: str, module: nn.Module) -> TypeError:
    return TypeError(
        f"zero.Init cannot initialize module '{name or '<root>'}' ({type(module).__name__}): "
        f"it owns parameters {sorted(module._parameters)} but has no reset_parameters(), and "
        "no enclosing model defines init_module_weights(name, module) or _init_weights(module). "
        "Define one of them, or build the model outside zero.Init"
    )


@torch.no_grad()
def materialize_(
    model: nn.Module,
    device: torch.device | str,
    sink: Callable[[nn.Parameter, torch.Tensor], None] | None = None,
    pending: set[int] | None = None,
) -> int:
    """Allocate and initialize ``model``'s meta parameters, module by module, in place.

    Args:
        model: a model with meta parameters (its non-meta parameters are left alone).
        device: where the parameters are created and initialized.
        sink: called with (parameter, full initialized value) once a parameter's value is
            final; it decides where the value goes (``zero.Init`` keeps a slice) and must
            leave ``parameter.data`` as it wants it. Without a sink the full value is kept.
        pending: ids of the parameters to materialize (default: those on the meta device).
    Returns:
        The largest number of parameter elements materialized at once (peak extra memory).
    """
    modules = list(model.named_modules())
    rng = next((getattr(m, _RNG_ATTR) for _, m in modules if hasattr(m, _RNG_ATTR)), None)
    with _replayed_rng(rng):
        return _materialize(modules, torch.device(device), sink, pending)


def _materialize(
    modules: list[tuple[str, nn.Module]],
    device: torch.device,
    sink: Callable[[nn.Parameter, torch.Tensor], None] | None,
    pending: set[int] | None,
) -> int:
    """``materialize_`` under the RNG state the caller set up."""
    if pending is None:
        pending = {
            id(p) for _, m in modules for p in m._parameters.values() if p is not None and p.is_meta
        }
    pending = set(pending)
    if not pending:
        return 0
    remaining: dict[int, int] = {}
    for _, mod in modules:
        for p in mod._parameters.values():
            if p is not None and id(p) in pending:
                remaining[id(p)] = remaining.get(id(p), 0) + 1
    inits = _initializers(modules)
    if not any(_has_model_initializer(m) for _, m in modules):
        # Only reset_parameters: initialize in construction order, as eager construction does
        # (a module registered under another name than the order it was built in, e.g. a
        # head built after the blocks but assigned first, then draws the same numbers).
        modules = sorted(modules, key=lambda nm: getattr(nm[1], _ORDER_ATTR, math.inf))
    live = peak = 0
    for name, mod in modules:
        held = [p for p in mod._parameters.values() if p is not None and id(p) in pending]
        mine = list({id(p): p for p in held}.values())  # a module may hold one twice
        if not mine:
            continue
        for p in mine:
            if p.is_meta:  # a tied parameter is allocated by its first module only
                set_data_(p, torch.empty(p.shape, dtype=p.dtype, device=device))
                live += p.numel()
        peak = max(peak, live)
        if id(mod) not in inits:
            raise _no_initializer(name, mod)
        inits[id(mod)]()
        for p in mine:
            remaining[id(p)] -= sum(q is p for q in held)
            if remaining[id(p)] == 0:
                live -= p.numel()
                if sink is not None:
                    sink(p, p.data)
                pending.discard(id(p))
    return peak


def _device() -> torch.device:
    """Where ``zero.Init`` creates shards: the engine's device (``initialize`` agrees)."""
    return torch.device(get_accelerator().current_device_name())


def _roots(modules: list[nn.Module]) -> list[nn.Module]:
    """The modules that are no other listed module's descendant, in the given order."""
    inner = {id(c) for m in modules for c in m.modules() if c is not m}
    return [m for m in modules if id(m) not in inner]


def _agreed_rng(roots: list[nn.Module], rng: dict[str, Any] | None) -> dict[str, Any] | None:
    """Rank 0's RNG state, after checking every rank built the same parameters (one small
    collective; a world of one skips it). Ranks seeded differently still get rank 0's
    values, as DeepSpeed's broadcast from rank 0 gives."""
    if comm.get_world_size() == 1:
        return rng
    layout = [
        (n, tuple(p.shape), str(p.dtype))
        for r in roots
        for n, p in r.named_parameters()
        if p.is_meta
    ]
    every = comm.all_gather_object((layout, rng))
    if any(e[0] != layout for e in every):
        comm.check_same_across_ranks(layout, "model built under zero.Init")
    return every[0][1]


def partition_pending() -> int:
    """Partition the models built so far in the active ``zero.Init`` (collective when the
    world is larger than one). Returns the peak number of elements materialized at once."""
    built = list(getattr(_STATE, "built", {}).values())
    _STATE.built = {}
    roots = [m for m in _roots(built) if has_meta_parameters(m)]
    if not roots:
        return 0
    rng = _agreed_rng(roots, _STATE.rng)
    shards = InitShards()
    with _replayed_rng(rng):
        peak = max(_partition_root(r, shards) for r in roots)
        _STATE.rng = _capture_rng()  # a later partitioning continues the same stream
    _STATE.peak = max(getattr(_STATE, "peak", 0), peak)
    return peak


def partition_meta_(model: nn.Module) -> int:
    """Partition ``model``'s remaining meta parameters (``initialize`` calls this): those of
    an ``Init`` still open, then any other meta parameter, from the RNG state captured on the
    model. Returns the peak number of elements materialized at once."""
    peak = partition_pending() if deferred_init_active() else 0
    if not has_meta_parameters(model):
        return peak
    modules = list(model.named_modules())
    rng = next((getattr(m, _RNG_ATTR) for _, m in modules if hasattr(m, _RNG_ATTR)), None)
    rng = _agreed_rng([model], rng)
    with _replayed_rng(rng):
        return max(peak, _partition_root(model, InitShards()))


@torch.no_grad()
def partition_ordinary_(model: nn.Module) -> list[str]:
    """Partition, as ``zero.Init`` would have, the ordinary parameters of a model that is
    partly partitioned by it; ``initialize`` at ZeRO-3 calls this (DeepSpeed's engine does the
    same to the parameters its ``zero.Init`` did not make).

    Such parameters are made after the model was built: a head added after
    ``from_pretrained`` (DeepSpeed-Chat's reward ``v_head``), or the embedding (and untied
    ``lm_head``) that ``resize_token_embeddings`` rebuilds as plain modules. Their values must
    already be equal on every rank (``initialize`` broadcasts them from rank 0) and in the
    training dtype; each rank keeps its slice, as for a ``zero.Init`` parameter, and ZeRO-3
    re-lays the slices into its buckets. A model with no ``zero.Init`` parameter is left alone.
    Returns the names of the parameters partitioned here.
    """
    named = list(model.named_parameters())
    if not any(init_owner(p) is not None for _, p in named):
        return []
    shards = InitShards()
    done = []
    for name, p in named:  # unique parameters (a tied one once), the same order on every rank
        if init_owner(p) is not None or p.is_meta:
            continue
        shards.keep_shard_(p, p.data)
        done.append(name)
    return done


def _partition_root(root: nn.Module, shards: InitShards) -> int:
    peak = _materialize(list(root.named_modules()), _device(), shards.keep_shard_, None)
    for m in root.modules():
        if any(init_owner(p) is shards for p in m._parameters.values() if p is not None):
            shards.guard_forward(m)
    return peak


@torch.no_grad()
def _broadcast_ordinary(model: nn.Module) -> None:
    """Rank 0's values of the parameters of a partly ``zero.Init`` model that were made
    outside it (and so may differ across ranks: loaded on rank 0 only inside a
    ``GatheredParameters(modifier_rank=0)`` block, which passes them through), as DeepSpeed
    broadcasts them before partitioning."""
    if comm.get_world_size() == 1 or not any(init_owner(p) for p in model.parameters()):
        return
    for p in model.parameters():
        if init_owner(p) is None and not p.is_meta:
            comm.broadcast(p.data, src=0, label="init_params")


@torch.no_grad()
def unpartition_(model: nn.Module) -> None:
    """Give every rank the full value of each ``zero.Init`` parameter of ``model`` and make
    them ordinary parameters again (ZeRO stages 0-2 and inference hold the whole model).
    Collective: every rank calls it."""
    partition_meta_(model)
    _broadcast_ordinary(model)
    owners: dict[int, InitShards] = {}
    for p in model.parameters():  # unique parameters, the same order on every rank
        owner = init_owner(p)
        if owner is None:
            continue
        owners[id(owner)] = owner
        value = owner.full(p).view(full_shape(p))
        if value.dtype != p.dtype:  # initialize cast the placeholder to the training dtype
            value = value.to(p.dtype)
        elif owner.world == 1:
            value = value.clone()
        p.data = value
        unmark_(p)
    for owner in owners.values():
        owner.drop_guards(model)
