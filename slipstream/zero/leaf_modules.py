"""ZeRO-3 leaf modules: modules whose parameters are gathered as one unit (a mixture-of-experts
block whose experts run in a data-dependent order, or a block of many tiny layers).

The marking functions are DeepSpeed's (``deepspeed.utils``): by class (a type, a class name or
a fully qualified ``module.Class`` name), by ``named_modules()`` name, or by name suffix; by
default each raises a ``ValueError`` when nothing matches. ``apply_leaf_module_config`` applies
the ``zero_optimization.leaf_module`` block (``classes``, ``names``, ``name_suffixes``), which
``initialize`` does at stage 3 before it cuts the model into units. The mark is the attribute
``_z3_leaf`` that DeepSpeed sets, so modules marked by code written for DeepSpeed count too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from slipstream._logging import logger

__all__ = [
    "LEAF_ATTR",
    "apply_leaf_module_config",
    "get_z3_leaf_modules",
    "set_z3_leaf_module",
    "set_z3_leaf_modules",
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
    "z3_leaf_parameter",
]

LEAF_ATTR = "_z3_leaf"


def z3_leaf_module(module: nn.Module) -> bool:
    """Whether ``module`` is marked to be gathered as one ZeRO-3 unit."""
    return bool(getattr(module, LEAF_ATTR, False))


def z3_leaf_parameter(param: nn.Parameter) -> bool:
    """Whether ``param`` was tagged as belonging to a leaf module (``ds_z3_leaf_module``)."""
    return hasattr(param, "ds_z3_leaf_module")


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """The marked modules of ``model``, in ``modules()`` order."""
    return [m for m in model.modules() if z3_leaf_module(m)]


def set_z3_leaf_module(model: nn.Module, flag: bool) -> None:
    """Mark (or unmark) ``model`` itself."""
    setattr(model, LEAF_ATTR, flag)


def _class_matches(module: nn.Module, wanted: type | str) -> bool:
    if isinstance(wanted, type):
        return isinstance(module, wanted)
    cls = type(module)
    return wanted in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")


def _mark_classes(
    model: nn.Module, classes: Sequence[type | str], flag: bool, raise_if_not_found: bool
) -> list[nn.Module]:
    if not all(isinstance(c, type | str) for c in classes):
        raise TypeError(f"leaf module classes must be classes or class names, got {classes}")
    marked: list[nn.Module] = []
    # Children before parents (``Module.apply``'s order), as DeepSpeed returns them.
    model.apply(lambda m: marked.append(m) if any(_class_matches(m, c) for c in classes) else None)
    for m in marked:
        set_z3_leaf_module(m, flag)
    if not marked and raise_if_not_found:
        raise ValueError(
            f"No modules of type {list(classes)} found in model {type(model).__name__}"
        )
    return marked


def set_z3_leaf_modules(
    model: nn.Module, leaf_module_classes: Sequence[type | str], raise_if_not_found: bool = True
) -> list[nn.Module]:
    """Mark every module of these classes (types, class names or fully qualified names) as a
    leaf. Call before ``initialize``. Returns the modules marked.

    Raises:
        ValueError: nothing matched and ``raise_if_not_found``.
    """
    return _mark_classes(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(
    model: nn.Module, leaf_module_classes: Sequence[type | str], raise_if_not_found: bool = True
) -> list[nn.Module]:
    """Undo :func:`set_z3_leaf_modules` for these classes; returns the modules unmarked.

    Raises:
        ValueError: nothing matched and ``raise_if_not_found``.
    """
    return _mark_classes(model, leaf_module_classes, False, raise_if_not_found)


def set_z3_leaf_modules_by_name(
    model: nn.Module,
    module_names: Sequence[str],
    flag: bool = True,
    raise_if_not_found: bool = True,
) -> tuple[list[nn.Module], list[str]]:
    """Mark the modules with these ``named_modules()`` names; returns (marked, missing).

    Raises:
        ValueError: some name matched nothing and ``raise_if_not_found``.
    """
    by_name = dict(model.named_modules())
    marked = [by_name[n] for n in module_names if n in by_name]
    missing = [n for n in module_names if n not in by_name]
    for m in marked:
        set_z3_leaf_module(m, flag)
    if missing and raise_if_not_found:
        raise ValueError(f"No modules named {missing} found in model {type(model).__name__}")
    return marked, missing


def set_z3_leaf_modules_by_suffix(
    model: nn.Module,
    module_name_suffixes: Sequence[str],
    flag: bool = True,
    raise_if_not_found: bool = True,
) -> tuple[list[nn.Module], list[str]]:
    """Mark the modules whose ``named_modules()`` name ends with one of the suffixes; returns
    (marked, each once, in order; suffixes that matched nothing).

    Raises:
        ValueError: some suffix matched nothing and ``raise_if_not_found``.
    """
    named = list(model.named_modules())
    marked: list[nn.Module] = []
    missing: list[str] = []
    for suffix in module_name_suffixes:
        hits = [m for name, m in named if name.endswith(suffix)]
        if not hits:
            missing.append(suffix)
        for m in hits:
            set_z3_leaf_module(m, flag)
            if all(m is not seen for seen in marked):
                marked.append(m)
    if missing and raise_if_not_found:
        raise ValueError(
            f"No modules matching suffixes {missing} found in model {type(model).__name__}"
        )
    return marked, missing


def apply_leaf_module_config(model: nn.Module, leaf_cfg: Any) -> list[nn.Module]:
    """Mark the leaves the ``zero_optimization.leaf_module`` block names (its ``classes``,
    ``names`` and ``name_suffixes``); unmatched entries the user set are logged, as DeepSpeed
    does. Returns the modules marked, each once."""
    if leaf_cfg is None:
        return []
    from slipstream.config.zero import LeafModuleConfig

    defaults = LeafModuleConfig()
    found: list[nn.Module] = []
    if leaf_cfg.classes:
        found += set_z3_leaf_modules(model, leaf_cfg.classes, raise_if_not_found=False)
    if leaf_cfg.names:
        hits, missing = set_z3_leaf_modules_by_name(model, leaf_cfg.names, raise_if_not_found=False)
        found += hits
        if missing and leaf_cfg.names != defaults.names:
            logger.warning("zero_optimization.leaf_module.names matched no module: %s", missing)
    if leaf_cfg.name_suffixes:
        hits, missing = set_z3_leaf_modules_by_suffix(
            model, leaf_cfg.name_suffixes, raise_if_not_found=False
        )
        found += hits
        if missing and leaf_cfg.name_suffixes != defaults.name_suffixes:
            logger.warning(
                "zero_optimization.leaf_module.name_suffixes matched no module: %s", missing
            )
    unique: list[nn.Module] = []
    for m in found:
        if all(m is not u for u in unique):
            unique.append(m)
    customized = leaf_cfg.model_dump() != defaults.model_dump()
    if not unique and customized:
        logger.warning("zero_optimization.leaf_module matched no module; no leaves are marked")
    return unique
