"""Driving slipstream's reference GPT one step at a time with its own KV cache.

The decode loop needs the same four things from the GPT as from a Hugging Face model
(``hf.py``): the last position's logits of a chunk run against a cache, a cache, dropping
finished rows from it, and the context length. The GPT's forward takes ``attention_mask``,
``position_ids``, ``kv_cache`` and ``logits_to_keep`` for this (``slipstream.models.gpt``);
its cache is one preallocated buffer per layer (``slipstream.models.kv_cache``), so the
``kv_cache`` setting of ``init_inference`` ("dynamic"/"static", the transformers cache
classes) does not apply here.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from slipstream.config._errors import ConfigError
from slipstream.models.gpt import GPT
from slipstream.models.kv_cache import KVCache

__all__ = ["check_generation_ready", "context_length", "last_logits", "make_cache", "select_rows"]


def check_generation_ready(model: GPT) -> None:
    """Refuse, before any work, a GPT whose attention layers cannot take a KV cache.

    Raises:
        ConfigError: an attention layer was swapped for one without the cache arguments
            (the INT8 attention core of ``slipstream.quant`` with ``HeroModes(attn_core=True)``).
    """
    for i, layer in enumerate(model.layers):
        attn: Any = getattr(layer, "attn", None)
        if not getattr(attn, "takes_kv_cache", False):
            raise ConfigError(
                f"generate: layers.{i}.attn is {type(attn).__name__}, which has no KV-cache "
                "path; quantize with HeroModes(attn_core=False) (INT8 linear layers, float "
                "attention) to generate with the reference GPT"
            )


def last_logits(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    kv_cache: Any,
) -> torch.Tensor:
    """Run ``input_ids [b, t]`` against ``kv_cache`` (appended in place); return the last
    position's logits ``[b, vocab]`` (the LM head runs on that position only)."""
    logits = model(
        input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        kv_cache=kv_cache,
        logits_to_keep=1,
    )
    return logits[:, -1]  # type: ignore[no-any-return]


def make_cache(model: nn.Module, kind: str, max_len: int) -> KVCache:
    """The GPT's own cache for ``max_len`` positions (``kind`` is for transformers models)."""
    layers: Any = model.get_submodule("layers")
    return KVCache(len(layers), max_len)


def select_rows(kv_cache: Any, rows: torch.Tensor) -> None:
    """Keep only batch ``rows`` of the cache, in place."""
    kv_cache.select_rows(rows)


def context_length(model: nn.Module) -> int | None:
    """The GPT's RoPE table length (``config.max_seq_len``)."""
    config: Any = model.config
    return int(config.max_seq_len)
