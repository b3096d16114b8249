"""DeepSpeed's ``deepspeed.checkpoint.utils.clone_tensors_for_torch_save`` (Accelerate calls
it to save a ZeRO-0/1/2 model's state dict): ``torch.save`` of a view writes its whole
storage, so each tensor is copied into its own."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["clone_tensors_for_torch_save"]


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = "cpu") -> Any:
    """``item`` with every tensor (nested in lists, tuples and dicts) copied to ``device``,
    detached, in storage of its own; other values as they are."""
    if isinstance(item, torch.Tensor):
        target = torch.device(device)
        if item.device == target:
            return item.detach().clone()
        return item.detach().to(target)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item
