"""Build the optimizer and lr scheduler named by a DeepSpeed config block.

Names are case-insensitive. Optimizers: DeepSpeed's ``Adam``, ``AdamW``, ``Lamb``, ``Lion``,
``Adagrad`` and ``SGD``, then any ``torch.optim`` class. Schedulers: DeepSpeed's five (see
``schedules.py``), then any ``torch.optim.lr_scheduler`` class. Params are checked against the
constructor signature: an unknown key, an unresolved ``"auto"`` or an unknown name is a
``ConfigError`` naming the dotted key with a did-you-mean, never a silent drop.

DeepSpeed-only optimizer keys that pick an implementation without changing the math are
accepted and dropped: ``torch_adam`` (torch vs fused kernel; it only decides the default
``weight_decay``, see below) and ``set_grad_none`` (``zero_grad`` already sets grads to None).
``bias_correction: true`` (Adam) and ``amsgrad: false`` (Lamb) are accepted as the only values
DeepSpeed's kernels support. ``fused``/``foreach`` are *not* DeepSpeed keys: they pass through
to the torch classes that take them and are unknown elsewhere.

Defaults follow what DeepSpeed would build, which differs from the torch class in two places:
``Adam``/``AdamW`` default to ``weight_decay=0`` (DeepSpeed's FusedAdam/CPUAdam; torch AdamW
uses 0.01, which DeepSpeed also gets with ``torch_adam: true``), and ``Lion`` defaults to
``lr=1e-3, betas=(0.9, 0.999)`` (DeepSpeed's FusedLion; the ``Lion`` class uses the paper's).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.optim import Optimizer
from torch.optim import lr_scheduler as torch_lr_scheduler

from slipstream.config._errors import ConfigError, did_you_mean, type_error_message
from slipstream.optim.lamb import Lamb
from slipstream.optim.lion import Lion
from slipstream.optim.schedules import (
    LRRangeTest,
    OneCycle,
    SupportsParamGroups,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
)

__all__ = ["build_optimizer", "build_scheduler", "optimizer_defaults"]

# DeepSpeed optimizers slipstream knows by name but does not implement yet. "Muon" is not mapped
# to torch.optim.Muon: DeepSpeed's Muon also runs AdamW on the non-matrix params.
_NOT_IMPLEMENTED = ("OneBitAdam", "ZeroOneAdam", "OneBitLamb", "MuAdam", "MuAdamW", "MuSGD", "Muon")

_OWN_OPTIMIZERS = ("Adam", "AdamW", "SGD", "Lamb", "Lion", "Adagrad")

# Constructor keywords that pick an implementation, not a hyperparameter.
_IMPL_KNOBS = frozenset({"foreach", "fused", "capturable", "differentiable"})

# torch classes with a fused kernel on both CUDA and CPU (torch >= 2.4).
_FUSABLE = (torch.optim.Adam, torch.optim.AdamW)

_SCHEDULERS: dict[str, type] = {
    cls.__name__.lower(): cls
    for cls in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)
}


@dataclass
class _Choice:
    """What a config ``optimizer`` block resolves to."""

    cls: type[Optimizer]
    kwargs: dict[str, Any]
    """The params left for the constructor once DeepSpeed-only keys are taken out."""
    ds_defaults: dict[str, Any] = field(default_factory=dict)
    """DeepSpeed's defaults where they differ from ``cls``'s."""
    ds_keys: frozenset[str] = frozenset()
    """DeepSpeed-only keys accepted for this type."""


def _torch_classes(module: Any, base: type) -> dict[str, type]:
    found: dict[str, type] = {}
    for name, obj in vars(module).items():
        if isinstance(obj, type) and issubclass(obj, base) and not name.startswith("_"):
            found[name.lower()] = obj
    return found


def _torch_optimizers() -> dict[str, type]:
    classes = _torch_classes(torch.optim, Optimizer)
    classes.pop("optimizer", None)
    return classes


def _torch_schedulers() -> dict[str, type]:
    classes = _torch_classes(torch_lr_scheduler, torch_lr_scheduler.LRScheduler)
    classes.pop("lrscheduler", None)
    classes["reducelronplateau"] = torch_lr_scheduler.ReduceLROnPlateau
    return classes


def _unknown_type(
    section: str, value: str, supported: Iterable[str], torch_names: Iterable[str]
) -> ConfigError:
    own = list(supported)
    skip = {n.lower() for n in (*own, *_NOT_IMPLEMENTED)}
    others = sorted({n for n in torch_names if n.lower() not in skip}, key=str.lower)
    hint = did_you_mean(value, [*own, *others])
    msg = f"unknown {section}.type '{value}'"
    msg += f"; did you mean '{hint}'?" if hint is not None else "."
    module = "torch.optim" if section == "optimizer" else "torch.optim.lr_scheduler"
    return ConfigError(
        f"{msg} Supported (any case): {', '.join(own)}, or a {module} class: {', '.join(others)}."
    )


def _reject_auto(section: str, params: Mapping[str, Any]) -> None:
    for key, value in params.items():
        if isinstance(value, str) and value == "auto":
            raise ConfigError(
                f"{section}.params.{key} is 'auto' but nothing resolved it; load the config "
                f"with slipstream's loader (it resolves 'auto') or set a value"
            )


def _pop_bool(kwargs: dict[str, Any], key: str, default: bool) -> bool:
    value = kwargs.pop(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"optimizer.params.{key} must be true or false, got {value!r}")
    return value


def _resolve_adam(is_adamw: bool, kwargs: dict[str, Any]) -> _Choice:
    """DeepSpeed's Adam family: ``adam_w_mode`` (default true) picks decoupled weight decay."""
    torch_adam = _pop_bool(kwargs, "torch_adam", False)
    adam_w_mode = _pop_bool(kwargs, "adam_w_mode", True)
    if is_adamw and not adam_w_mode:
        raise ConfigError(
            "optimizer.params.adam_w_mode is false but optimizer.type is 'AdamW' (DeepSpeed "
            "ignores the flag and runs AdamW); use type 'Adam' with adam_w_mode false for "
            "Adam with L2 regularisation, or remove the key"
        )
    if not _pop_bool(kwargs, "bias_correction", True):
        raise ConfigError(
            "optimizer.params.bias_correction=false is not supported (torch Adam always "
            "corrects the moment bias); remove the key"
        )
    kwargs.pop("set_grad_none", None)
    cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    ds_defaults = {} if torch_adam else {"weight_decay": 0.0}
    keys = frozenset({"torch_adam", "adam_w_mode", "bias_correction", "set_grad_none"})
    return _Choice(cls, kwargs, ds_defaults, keys)


def _resolve_optimizer(type_name: str, params: Mapping[str, Any]) -> _Choice:
    key = type_name.lower()
    kwargs = dict(params)
    if key in ("adam", "adamw"):
        return _resolve_adam(key == "adamw", kwargs)
    if key == "lamb":
        if _pop_bool(kwargs, "amsgrad", False):
            raise ConfigError("optimizer.params.amsgrad=true is not supported by Lamb")
        return _Choice(Lamb, kwargs, ds_keys=frozenset({"amsgrad"}))
    if key == "lion":
        kwargs.pop("set_grad_none", None)
        ds_defaults = {"lr": 1e-3, "betas": (0.9, 0.999)}
        return _Choice(Lion, kwargs, ds_defaults, frozenset({"set_grad_none"}))
    for name in _NOT_IMPLEMENTED:
        if key == name.lower():
            raise ConfigError(
                f"optimizer.type '{type_name}' is a DeepSpeed optimizer that slipstream does not "
                f"implement yet; use one of {', '.join(_OWN_OPTIMIZERS)} or a torch.optim class"
            )
    torch_classes = _torch_optimizers()
    if key in torch_classes:
        return _Choice(torch_classes[key], kwargs)
    torch_names = [c.__name__ for c in torch_classes.values()]
    raise _unknown_type("optimizer", type_name, _OWN_OPTIMIZERS, torch_names)


def _check_keys(section: str, cls: type, kwargs: Mapping[str, Any], extra: Iterable[str]) -> None:
    """Every key must be a constructor keyword (past the first argument) or an accepted extra."""
    sig = inspect.signature(cls)
    args = [
        p
        for p in list(sig.parameters.values())[1:]  # skip params / optimizer
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        return
    valid = sorted({p.name for p in args} | set(extra))
    for key in kwargs:
        if key not in valid:
            hint = did_you_mean(key, valid)
            tip = f"; did you mean '{hint}'?" if hint else ""
            raise ConfigError(
                f"unknown config key '{section}.params.{key}' for {section} type "
                f"'{cls.__name__}'{tip} Valid keys: {', '.join(valid)}."
            )
    for p in args:
        if p.default is p.empty and p.name not in kwargs:
            raise ConfigError(
                f"{section}.params.{p.name} is required by {section} type '{cls.__name__}'"
            )


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float | torch.Tensor) and not isinstance(value, bool)


def _type_error(section: str, key: str, value: Any, default: Any) -> str | None:
    """Why ``value`` cannot stand where the constructor's default is ``default``, or None.

    The default's type is the contract (torch writes ``momentum: float = 0``, so an int
    default means "a number"); None or other defaults are not checked. A list of numbers
    passes for a number: DeepSpeed's schedules take one value per param group.
    """
    path = f"{section}.params.{key}"
    if isinstance(default, bool):
        return None if isinstance(value, bool) else type_error_message(path, value, "bool_type")
    if _is_number(default):
        per_group = isinstance(value, list | tuple) and all(_is_number(v) for v in value)
        ok = _is_number(value) or per_group
        return None if ok else type_error_message(path, value, "float_type")
    if isinstance(default, str):
        return None if isinstance(value, str) else type_error_message(path, value, "string_type")
    if isinstance(default, tuple) and default and all(_is_number(d) for d in default):
        if isinstance(value, list | tuple) and all(_is_number(v) for v in value):
            return None
        return f"config key '{path}' = {value!r}: expected a list of numbers like {list(default)}"
    return None


def _check_types(section: str, cls: type, kwargs: dict[str, Any]) -> None:
    """Every value has the JSON type of its constructor default (no string or boolean
    stands for a number), so a typo is named here rather than deep inside the class.

    As in the typed config, an integral float becomes an int where the default is an int
    (``"warmup_num_steps": 1e3``): JSON has a single number type.
    """
    params = inspect.signature(cls).parameters
    for key, value in kwargs.items():
        param = params.get(key)
        if param is None or param.default is param.empty:
            continue
        problem = _type_error(section, key, value, param.default)
        if problem is not None:
            raise ConfigError(problem)
        int_default = isinstance(param.default, int) and not isinstance(param.default, bool)
        if int_default and isinstance(value, float) and value.is_integer():
            kwargs[key] = int(value)


def _construct(section: str, cls: type, first: Any, kwargs: dict[str, Any]) -> Any:
    try:
        return cls(first, **kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as err:
        raise ConfigError(
            f"{section} type '{cls.__name__}' rejected {section}.params: {err}"
        ) from err


def build_optimizer(
    type_name: str,
    params: Mapping[str, Any],
    param_groups: Iterable[Any],
    *,
    prefer_fused: bool = False,
) -> Optimizer:
    """Build the optimizer a DeepSpeed ``optimizer`` block names.

    Args:
        type_name: ``optimizer.type``, case-insensitive (see the module docstring).
        params: ``optimizer.params``; DeepSpeed's defaults fill what is missing.
        param_groups: parameters or param-group dicts, as for any ``torch.optim`` class.
        prefer_fused: build torch's ``Adam``/``AdamW`` with ``fused=True`` unless the params
            pick an implementation (``fused``/``foreach``/``capturable``/``differentiable``).
            The engine sets it when training runs on an accelerator, where DeepSpeed uses its
            fused kernels too: ``FusedAdam`` on the GPU and ``DeepSpeedCPUAdam`` for offloaded
            states (torch's fused CPU kernel was 7x its default loop on a 2-core CPU).

    Returns:
        The optimizer. ``Adam`` is ``torch.optim.AdamW`` unless ``adam_w_mode`` is false
        (then ``torch.optim.Adam``, L2 added to the gradient).

    Raises:
        ConfigError: unknown, unimplemented or misspelled type; unknown, ``"auto"`` or
            invalid param (naming ``optimizer.params.<key>``); ``max_grad_norm`` given.
    """
    _reject_auto("optimizer", params)
    if "max_grad_norm" in params:
        raise ConfigError(
            "optimizer.params.max_grad_norm is not supported; use the top-level "
            "'gradient_clipping' key instead (as DeepSpeed requires)"
        )
    choice = _resolve_optimizer(type_name, params)
    _check_keys("optimizer", choice.cls, choice.kwargs, choice.ds_keys)
    _check_types("optimizer", choice.cls, choice.kwargs)
    kwargs = {**choice.ds_defaults, **choice.kwargs}
    if isinstance(kwargs.get("betas"), list):
        kwargs["betas"] = tuple(kwargs["betas"])
    if prefer_fused and choice.cls in _FUSABLE and not _IMPL_KNOBS & kwargs.keys():
        kwargs["fused"] = True
    optimizer: Optimizer = _construct("optimizer", choice.cls, param_groups, kwargs)
    return optimizer


def optimizer_defaults(type_name: str, params: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The hyperparameter defaults ``build_optimizer(type_name, params, ...)`` would use.

    Used to resolve ``"auto"`` values. ``params`` matters only through the keys that choose the
    class or its defaults (``adam_w_mode``, ``torch_adam``). Implementation knobs (``foreach``,
    ``fused``, ``capturable``, ``differentiable``) are left out.

    Raises:
        ConfigError: as ``build_optimizer`` for the type.
    """
    choice = _resolve_optimizer(type_name, params or {})
    sig = inspect.signature(choice.cls)
    defaults = {
        name: p.default
        for name, p in sig.parameters.items()
        if p.default is not p.empty and name not in _IMPL_KNOBS
    }
    return {**defaults, **choice.ds_defaults}


def build_scheduler(
    type_name: str, params: Mapping[str, Any], optimizer: SupportsParamGroups
) -> Any:
    """Build the lr scheduler a DeepSpeed ``scheduler`` block names.

    Args:
        type_name: ``scheduler.type``: ``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``,
            ``OneCycle``, ``LRRangeTest`` or a ``torch.optim.lr_scheduler`` class, any case.
        params: ``scheduler.params``, passed as keyword arguments.
        optimizer: the optimizer whose param groups' ``lr`` the scheduler drives.

    Returns:
        A scheduler with ``step()``, ``get_lr()``, ``get_last_lr()``, ``state_dict()`` and
        ``load_state_dict()``. DeepSpeed's schedules write their first lr at construction.

    Raises:
        ConfigError: unknown type, unknown/missing/``"auto"``/invalid param (naming
            ``scheduler.params.<key>``).
    """
    _reject_auto("scheduler", params)
    key = type_name.lower()
    torch_classes = _torch_schedulers()
    cls = _SCHEDULERS.get(key) or torch_classes.get(key)
    if cls is None:
        own = [c.__name__ for c in _SCHEDULERS.values()]
        raise _unknown_type(
            "scheduler", type_name, own, [c.__name__ for c in torch_classes.values()]
        )
    kwargs = dict(params)
    _check_keys("scheduler", cls, kwargs, ())
    _check_types("scheduler", cls, kwargs)
    return _construct("scheduler", cls, optimizer, kwargs)
