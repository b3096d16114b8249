"""Expert-parameter helpers (``deepspeed.moe.utils``): find MoE layers, tell expert parameters
apart, and split optimizer param groups so expert parameters get groups of their own."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import nn

from slipstream.moe.autoep import AutoEPExperts
from slipstream.moe.dropless import DroplessMoE
from slipstream.moe.layer import MoE

__all__ = [
    "configure_moe_param_groups",
    "has_moe_layers",
    "is_moe_param",
    "is_moe_param_group",
    "moe_layers",
    "split_params_grads_into_shared_and_expert_params",
    "split_params_into_different_moe_groups_for_optimizer",
    "split_params_into_shared_and_expert_params",
]


def moe_layers(module: nn.Module) -> list[MoE | DroplessMoE | AutoEPExperts]:
    """Every :class:`MoE`, :class:`DroplessMoE` and AutoEP layer inside ``module``, in module
    order."""
    return [m for m in module.modules() if isinstance(m, MoE | DroplessMoE | AutoEPExperts)]


def has_moe_layers(m: nn.Module) -> tuple[bool, int]:
    """``(True, num_experts of the first MoE layer)``, or ``(False, 0)`` without MoE layers
    (``m``: DeepSpeed's argument name)."""
    layers = moe_layers(m)
    return (True, layers[0].num_experts) if layers else (False, 0)


def is_moe_param(param: torch.Tensor) -> bool:
    """Whether ``param`` is an expert parameter (marked ``allreduce = False`` by its layer)."""
    return getattr(param, "allreduce", True) is False


def split_params_into_shared_and_expert_params(
    params: list[nn.Parameter],
) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``(shared, expert)`` parameters, each in the given order."""
    shared = [p for p in params if not is_moe_param(p)]
    return shared, [p for p in params if is_moe_param(p)]


def split_params_grads_into_shared_and_expert_params(
    group: list[nn.Parameter],
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Gradients (cast to each parameter's dtype) of ``(shared, expert)`` parameters that
    have one."""
    shared, expert = split_params_into_shared_and_expert_params(
        [p for p in group if p.grad is not None]
    )
    return [p.grad.to(p.dtype) for p in shared], [p.grad.to(p.dtype) for p in expert]  # type: ignore[union-attr]


def split_params_into_different_moe_groups_for_optimizer(
    param_groups: dict[str, Any] | tuple[dict[str, Any], ...] | list[dict[str, Any]],
    max_group_size: int | float | None = 178956971,
) -> list[dict[str, Any]]:
    """Move expert parameters out of ``param_groups`` into groups of their own.

    Each input group keeps its non-expert parameters; for each input group and each expert
    group name (``ep_size_<n>``) a copy of the group's hyperparameters is appended with
    ``name`` set to the expert group name, ``moe=True`` and that group's expert parameters,
    cut into groups of at most ``max_group_size`` elements. Input groups need a ``name``.
    The input list (or dict) is modified in place, as DeepSpeed does.

    Raises:
        ValueError: ``param_groups`` is not a dict, tuple or list of dicts.
    """
    if isinstance(param_groups, tuple):
        groups = list(param_groups)
    elif isinstance(param_groups, dict):
        groups = [param_groups]
    elif isinstance(param_groups, list):
        groups = param_groups
    else:
        raise ValueError(f"Unknown param group type of {type(param_groups)}")
    names: list[str] = []
    for g in groups:
        for p in g["params"]:
            if is_moe_param(p) and p.group_name not in names:
                names.append(p.group_name)
    moe: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for g in groups:
        for n in names:
            moe[g["name"]][n] = {**g, "name": n, "moe": True, "params": []}
    for g in groups:
        kept = []
        for p in g["params"]:
            if is_moe_param(p):
                moe[g["name"]][p.group_name]["params"].append(p)
            else:
                kept.append(p)
        g["params"] = kept
    for by_name in moe.values():
        for g in by_name.values():
            for chunk in _chunks(g["params"], max_group_size):
                groups.append({**g, "params": chunk})
    return groups


def _chunks(params: list[nn.Parameter], limit: int | float | None) -> list[list[nn.Parameter]]:
    """Consecutive runs of ``params`` of at most ``limit`` elements (a bigger one alone)."""
    if limit is None:
        return [params]
    out: list[list[nn.Parameter]] = []
    cur: list[nn.Parameter] = []
    size = 0
    for p in params:
        if cur and size + _numel(p) > limit:
            out.append(cur)
            cur, size = [], 0
        cur.append(p)
        size += _numel(p)
    if cur:
        out.append(cur)
    return out


def is_moe_param_group(param_group: dict[str, Any]) -> bool:
    """Whether an optimizer param group holds expert parameters."""
    return bool(param_group.get("moe", False))


def configure_moe_param_groups(model_parameters: list[Any]) -> list[dict[str, Any]]:
    """MoE-aware param groups from a list of parameters or of param-group dicts.

    Raises:
        TypeError: an element is neither a tensor nor a dict.
    """
    for p in model_parameters:
        if not isinstance(p, torch.Tensor | dict):
            raise TypeError(
                "param argument that would be given to the optimizer should be an iterable of "
                f"Tensors or dicts, but got {type(p)}"
            )
    if isinstance(model_parameters[0], torch.Tensor):
        return split_params_into_different_moe_groups_for_optimizer(
            {"params": model_parameters, "name": "dense-params"}
        )
    if any("moe" in g for g in model_parameters):
        return model_parameters
    return split_params_into_different_moe_groups_for_optimizer(model_parameters)


def _numel(p: nn.Parameter) -> int:
    """Elements of ``p``, its full size when ZeRO-3 partitioned it (``ds_numel``)."""
    return int(getattr(p, "ds_numel", p.numel()))
