"""Sharded construction for ZeRO-3: ``zero.Init`` and the materializer behind it.

Inside ``with slipstream.zero.Init():`` every parameter a module registers is replaced by a
meta tensor of the same shape, dtype and ``requires_grad`` (buffers stay real: they are small
and often computed in ``__init__``). So building the model costs no parameter memory; at most
one freshly created tensor exists at a time, until its module registers it.

``initialize`` with stage 3 then *materializes* the model into its ZeRO-3 shards one module at
a time (``materialize_``): each module's own parameters are allocated in full, initialized,
the slice this rank owns is copied into its shard, and the full tensor is freed. Peak extra
memory is the largest module's own parameters, never the model. All ranks draw the same random
numbers (the RNG state is the one captured when the first parameter was created), so the result needs no
communication and does not depend on the world size.

How a module is initialized, first match wins:

1. ``init_module_weights(name, module)`` of the nearest enclosing model that has it
   (slipstream's reference models), or its ``_init_weights(module)`` (Hugging Face
   ``PreTrainedModel``);
2. ``module.reset_parameters()`` (every ``torch.nn`` layer with parameters).

For a model whose eager ``__init__`` runs the same per-module initializer in ``named_modules``
order from the same RNG state (``slipstream.models.GPT`` does), the weights equal eager
construction bit for bit. Otherwise they are drawn from the same initializers in a different
order: same distributions, not the same numbers.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook

__all__ = ["Init", "deferred_init_active", "has_meta_parameters", "materialize_", "set_data_"]

_STATE = threading.local()
_RNG_ATTR = "_slipstream_init_rng"  # RNG state captured at Init entry, kept on the root model


def deferred_init_active() -> bool:
    """True inside ``zero.Init()``: models should not materialize their parameters."""
    return bool(getattr(_STATE, "depth", 0))


def has_meta_parameters(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


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
        bad = [k for k, v in unsupported.items() if v]
        if bad:
            raise NotImplementedError(
                f"zero.Init({bad[0]}=...) is not supported: build the model inside the "
                "context and pass it to slipstream.initialize (which shards it over the "
                "engine's data-parallel group); parameter offload (remote_device) is not "
                "implemented yet"
            )
        del mem_efficient_linear  # a DeepSpeed memory trick for Linear; ours needs none
        source = config_dict_or_path if config_dict_or_path is not None else config
        if source is not None:
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
        self._handle: Any = None

    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        _STATE.depth = getattr(_STATE, "depth", 0) + 1
        if _STATE.depth == 1:
            _STATE.rng = None  # captured at the first parameter: seeding inside is fine
        self._handle = register_module_parameter_registration_hook(self._to_meta)  # type: ignore[arg-type]
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.enabled:
            return
        self._handle.remove()
        _STATE.depth -= 1

    def _to_meta(self, module: nn.Module, name: str, param: Any) -> nn.Parameter | None:
        if param is None:
            return None
        # Remember the RNG state on every module built here; the root is among them.
        if _STATE.rng is None:
            _STATE.rng = _capture_rng()
        if not hasattr(module, _RNG_ATTR):
            object.__setattr__(module, _RNG_ATTR, _STATE.rng)
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
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


@contextmanager
def _replayed_rng(state: dict[str, Any] | None) -> Iterator[None]:
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        if state is not None:
            torch.set_rng_state(state["cpu"])
            if "cuda" in state and devices:
                torch.cuda.set_rng_state(state["cuda"])
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
        if callable(getattr(mod, "init_module_weights", None)) or callable(
            getattr(mod, "_init_weights", None)
        ):
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
        model: a model built under ``zero.Init`` (its non-meta parameters are left alone).
        device: where the parameters are created and initialized.
        sink: called with (parameter, full initialized value) once a parameter's value is
            final; it decides where the value goes (ZeRO-3 keeps a slice) and must leave
            ``parameter.data`` as it wants it. Without a sink the full value is kept.
        pending: ids of the parameters to materialize (default: those on the meta device;
            pass it when their ``.data`` was already redirected, as ZeRO-3 does).
    Returns:
        The largest number of parameter elements materialized at once (peak extra memory).
    """
    device = torch.device(device)
    if pending is None:
        pending = {id(p) for p in model.parameters() if p.is_meta}
    pending = set(pending)
    if not pending:
        return 0
    remaining: dict[int, int] = {}
    modules = list(model.named_modules())
    for _, mod in modules:
        for p in mod._parameters.values():
            if p is not None and id(p) in pending:
                remaining[id(p)] = remaining.get(id(p), 0) + 1
    inits = _initializers(modules)
    saved: dict[int, torch.Tensor | None] = {}  # id(param) -> its data before (None: meta)
    live = peak = 0
    rng = next((getattr(m, _RNG_ATTR) for _, m in modules if hasattr(m, _RNG_ATTR)), None)
    with _replayed_rng(rng):
        for name, mod in modules:
            held = [p for p in mod._parameters.values() if p is not None and id(p) in pending]
            mine = list({id(p): p for p in held}.values())  # a module may hold one twice
            if not mine:
                continue
            for p in mine:
                if id(p) not in saved:
                    saved[id(p)] = None if p.is_meta else p.data
                    set_data_(p, torch.empty(p.shape, dtype=p.dtype, device=device))
                    live += p.numel()
            peak = max(peak, live)
            if id(mod) not in inits:
                raise _no_initializer(name, mod)
            inits[id(mod)]()
            for p in mine:
                remaining[id(p)] -= sum(q is p for q in held)
                if remaining[id(p)] == 0:
                    full, before = p.data, saved.pop(id(p))
                    if sink is not None:
                        if before is not None:
                            p.data = before
                        sink(p, full)
                    pending.discard(id(p))
                    live -= p.numel()
    return peak
