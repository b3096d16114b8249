"""Dotted-path access to submodules, as ``deepspeed.compression.helper`` offers it.

DeepSpeed-Chat's LoRA conversion imports these two names to swap ``nn.Linear`` layers by
their dotted names (``"transformer.h.0.mlp.c_fc"``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["convert_conv1d_to_linear", "recursive_getattr", "recursive_setattr"]


def recursive_getattr(model: Any, module_name: str) -> Any:
    """The attribute of ``model`` at the dotted path ``module_name`` (``"a.b.c"``).

    Raises:
        AttributeError: a part of the path is missing; the message names the path and the part.
    """
    obj = model
    for part in module_name.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise AttributeError(
                f"recursive_getattr: {type(obj).__name__} has no attribute {part!r} "
                f"(path {module_name!r})"
            ) from None
    return obj


def recursive_setattr(model: Any, module_name: str, module: Any) -> None:
    """Set the attribute at the dotted path ``module_name`` of ``model`` to ``module``."""
    parent_name, _, leaf = module_name.rpartition(".")
    parent = recursive_getattr(model, parent_name) if parent_name else model
    setattr(parent, leaf, module)


def convert_conv1d_to_linear(model: Any, convert_type: type) -> Any:
    """Replace every ``convert_type`` module (GPT-2's ``Conv1D``, weight ``(in, out)``) with
    an equivalent ``nn.Linear`` (weight ``(out, in)``), so compression can select it; returns
    the model (DeepSpeedExamples' GPT-2 compression script calls this first)."""
    from torch import nn

    root = getattr(model, "module", model)
    for name, found in list(root.named_modules()):
        if not isinstance(found, convert_type):
            continue
        module: Any = found
        d_in, d_out = module.weight.shape
        linear = nn.Linear(d_in, d_out, bias=module.bias is not None)
        linear = linear.to(device=module.weight.device, dtype=module.weight.dtype)
        linear.weight.data = module.weight.data.t().contiguous()
        if module.bias is not None:
            linear.bias.data = module.bias.data.view(-1)
        recursive_setattr(root, name, linear)
    return model
