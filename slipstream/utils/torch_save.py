"""``deepspeed.checkpoint.utils``: ``clone_tensors_for_torch_save`` (Accelerate calls it to save
a ZeRO-0/1/2 model's state dict: ``torch.save`` of a view writes its whole storage, so each
tensor is copied into its own) and the file names of DeepSpeed's checkpoint layout
(``slipstream convert --to deepspeed`` writes that layout, ``load_checkpoint`` reads it)."""

from __future__ import annotations

import os
from typing import Any

import torch

__all__ = [
    "clone_tensors_for_torch_save",
    "get_layer_ckpt_name_for_rank",
    "get_model_ckpt_name_for_rank",
    "get_zero_ckpt_name_for_rank",
]

MODEL_FILE_PREFIX = "mp_rank_"
MODEL_FILE_SUFFIX = "_model_states.pt"
ZERO_FILE_PREFIX = "zero_pp_rank_"
OPTIM_FILE_SUFFIX = "_optim_states.pt"


def get_model_ckpt_name_for_rank(base_folder: str, mp_rank_str: str) -> str:
    """``<base_folder>/mp_rank_<mp_rank_str>_model_states.pt`` (``mp_rank_str`` like ``"00"``)."""
    return os.path.join(base_folder, f"{MODEL_FILE_PREFIX}{mp_rank_str}{MODEL_FILE_SUFFIX}")


def get_zero_ckpt_name_for_rank(base_folder: str, dp_rank: int, mp_rank: int) -> str:
    """``<base_folder>/zero_pp_rank_<dp>_mp_rank_<mp:02d>_optim_states.pt``."""
    name = f"{ZERO_FILE_PREFIX}{dp_rank}_{MODEL_FILE_PREFIX}{mp_rank:02d}{OPTIM_FILE_SUFFIX}"
    return os.path.join(base_folder, name)


def get_layer_ckpt_name_for_rank(base_folder: str, layer_id: str, tp_rank: int) -> str:
    """``<base_folder>/<layer_id>-model_<tp:02d>_model_states.pt`` (a pipeline layer file)."""
    return os.path.join(base_folder, f"{layer_id}-model_{tp_rank:02d}{MODEL_FILE_SUFFIX}")


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
