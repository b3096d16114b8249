"""Driving a Hugging Face causal LM one step at a time with its own cache classes.

The decode loop (``generation.py``) needs four things from a model: run a chunk of tokens
against a cache and return the last position's logits, make a cache, drop finished rows
from it, and the model's context length. This module provides them for any
``transformers`` causal LM (LLaMA family, GPT-2, ...), through the public forward
signature: ``input_ids``, ``attention_mask``, ``position_ids`` and the cache argument
(``cache`` in transformers >= 5, ``past_key_values`` before).
"""

from __future__ import annotations

import inspect
from functools import cache
from typing import Any, Literal

import torch
from torch import nn

__all__ = [
    "CacheKind",
    "cache_argument",
    "context_length",
    "is_hf_causal_lm",
    "keep_argument",
    "last_logits",
    "make_cache",
    "select_rows",
]

CacheKind = Literal["dynamic", "static", "graph"]


def is_hf_causal_lm(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers model with a KV-cache forward (``GenerationMixin``)."""
    can_generate: Any = getattr(model, "can_generate", None)
    return hasattr(model, "config") and callable(can_generate) and bool(can_generate())


@cache
def cache_argument(forward_cls: Any) -> str:
    """The forward's keyword for the cache: ``cache`` (transformers >= 5) or
    ``past_key_values``."""
    params = inspect.signature(forward_cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@cache
def keep_argument(forward_cls: Any) -> str | None:
    """The forward's keyword for computing only the last logits, if it has one."""
    params = inspect.signature(forward_cls.forward).parameters
    for name in ("logits_to_keep", "num_logits_to_keep"):
        if name in params:
            return name
    return None


def last_logits(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    kv_cache: Any,
) -> torch.Tensor:
    """Run ``input_ids [b, t]`` through ``model`` against ``kv_cache`` (updated in place) and
    return the logits of the last position, ``[b, vocab]``.

    ``attention_mask [b, past + t]`` marks real tokens (1) and left padding (0);
    ``position_ids [b, t]`` count real tokens only, so a left-padded row sees the same
    positions as the unpadded prompt would.
    """
    model_cls: Any = type(model)  # the signature lookups are cached per class
    kwargs: dict[str, Any] = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        cache_argument(model_cls): kv_cache,
        "use_cache": True,
    }
    keep = keep_argument(model_cls)
    if keep is not None:
        kwargs[keep] = 1  # the LM head runs on the last position only
    out = model(**kwargs)
    logits = out.logits if hasattr(out, "logits") else out[0]
    return logits[:, -1]


def make_cache(model: nn.Module, kind: CacheKind, max_len: int) -> Any:
    """A fresh transformers cache for ``model``: ``DynamicCache`` (grows by concatenation)
    or ``StaticCache`` (preallocated for ``max_len`` tokens, written in place)."""
    import transformers

    config: Any = model.config
    if kind == "dynamic":
        try:
            return transformers.DynamicCache(config=config)
        except TypeError:  # transformers < 4.56 takes no config
            return transformers.DynamicCache()
    return transformers.StaticCache(config=config, max_cache_len=max_len)


def select_rows(kv_cache: Any, rows: torch.Tensor) -> None:
    """Keep only batch ``rows`` of every cached key and value, in place.

    Uses the cache's own ``batch_select_indices`` where its layers have it; static layers,
    which do not, get their preallocated tensors re-indexed (allocated again, smaller).
    """
    for layer in getattr(kv_cache, "layers", ()):
        if not getattr(layer, "is_initialized", True):
            continue
        if hasattr(layer, "max_cache_len"):
            layer.keys = layer.keys.index_select(0, rows)
            layer.values = layer.values.index_select(0, rows)
            if hasattr(layer, "batch_size"):
                layer.batch_size = rows.numel()
        else:
            layer.batch_select_indices(rows)
    if not hasattr(kv_cache, "layers"):
        kv_cache.batch_select_indices(rows)


def context_length(model: nn.Module) -> int | None:
    """The longest sequence ``model`` was built for (its position table), if it says."""
    config = getattr(model, "config", None)
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
