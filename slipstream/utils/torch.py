"""``deepspeed.utils.torch``: torch version checks and the gradient-hook helper."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.torch_version import TorchVersion

__all__ = ["register_grad_hook", "required_torch_version"]


def required_torch_version(
    min_version: float | str | None = None, max_version: float | str | None = None
) -> bool:
    """Whether the imported torch is at least ``min_version`` and at most ``max_version``.

    Raises:
        ValueError: neither bound is given.
    """
    if min_version is None and max_version is None:
        raise ValueError("required_torch_version: give min_version or max_version (or both)")
    found = TorchVersion(torch.__version__.split("+")[0])
    if min_version is not None and found < str(min_version):
        return False
    return not (max_version is not None and found > str(max_version))


def register_grad_hook(param: torch.Tensor, hook: Callable[[torch.Tensor], Any]) -> Any:
    """Run ``hook(param)`` once ``param.grad`` is accumulated (torch's post-accumulate hook)."""
    return param.register_post_accumulate_grad_hook(hook)
