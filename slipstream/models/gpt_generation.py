"""The reference GPT's forward for generation: a KV cache, left padding, explicit positions.

``GPT.forward`` hands over here when it gets ``attention_mask``, ``position_ids``,
``kv_cache`` or ``logits_to_keep``; without them it runs its training forward, unchanged.
The steps are the training forward's, with three differences: RoPE angles are looked up per
row from ``position_ids`` (a left-padded row sees the positions its unpadded prompt would),
each attention layer appends its keys and values to the cache and attends to all of them
under :func:`generation_mask` (causal, minus padding), and the LM head may run on the last
positions only. This module addresses the GPT by its stable module names, as its plans do,
so it does not import the model class.

The second half is the GPT's :class:`~slipstream.models.decoding.ModelDriver` (the decode
loop's access to it): the last position's logits of a chunk run against its cache, the cache
(one preallocated buffer per layer, :mod:`slipstream.models.kv_cache`; the ``kv_cache``
setting of ``init_inference``, the transformers cache classes, does not apply), dropping
finished rows from it, and the context length.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.config._errors import ConfigError
from slipstream.models.kv_cache import KVCache, LayerKV

__all__ = [
    "cached_attention",
    "check_generation_args",
    "check_generation_ready",
    "context_length",
    "forward_for_generation",
    "generation_mask",
    "last_logits",
    "make_cache",
    "select_rows",
]


def forward_for_generation(
    model: Any,
    input_ids: torch.Tensor,
    labels: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    kv_cache: KVCache | None,
    logits_to_keep: int,
) -> torch.Tensor:
    """``model``'s (a ``GPT``) forward with the generation arguments of ``GPT.forward``."""
    b, t = input_ids.shape
    if model.positions.span(t) != (0, t):  # a sequence-parallel plan's sharded positions
        raise ValueError(
            "GPT.forward: attention_mask / position_ids / kv_cache / logits_to_keep are for "
            "generation and do not combine with sequence parallelism (Ulysses/LSS); generate "
            "on a model without the sequence-parallel plan"
        )
    past = 0 if kv_cache is None else kv_cache.length
    check_generation_args(
        (b, t), past, labels=labels, attention_mask=attention_mask, kv_cache=kv_cache,
        logits_to_keep=logits_to_keep, num_layers=len(model.layers),
    )  # fmt: skip
    if position_ids is None:
        position_ids = torch.arange(past, past + t, device=input_ids.device).expand(b, t)
    top = int(position_ids.max()) if position_ids.numel() else 0
    if top >= model.config.max_seq_len:
        raise ValueError(
            f"position {top} exceeds GPTConfig.max_seq_len={model.config.max_seq_len}; "
            "shorten the prompt plus new tokens or build the model with a larger max_seq_len"
        )
    x = model.embed_dropout(model.embed_tokens(input_ids))
    cos = model.rope_cos[position_ids].to(x.dtype).unsqueeze(1)  # [B, 1, T, D]
    sin = model.rope_sin[position_ids].to(x.dtype).unsqueeze(1)
    mask = generation_mask(attention_mask, past, t, input_ids.device)
    for i, layer in enumerate(model.layers):
        x = layer(x, cos, sin, mask, None if kv_cache is None else kv_cache.layers[i])
    if logits_to_keep:
        x = x[:, -logits_to_keep:]
    return model.output(model.lm_head(model.norm(x)), labels)  # type: ignore[no-any-return]


def cached_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    kv: LayerKV | None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Rotated ``q [B, H, T, D]`` attending to the cached keys and values plus ``k``, ``v``
    ``[B, kv, T, D]`` (appended to ``kv`` first), under ``mask``; returns ``[B, T, H, D]``."""
    if kv is not None:
        k, v = kv.update(k, v)
    y = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout, enable_gqa=q.shape[1] != k.shape[1]
    )
    return y.transpose(1, 2)


def generation_mask(
    attention_mask: torch.Tensor | None, past: int, t: int, device: torch.device
) -> torch.Tensor | None:
    """``[B or 1, 1, t, past + t]`` bool: query i (position ``past + i``) may attend key j.

    Causal (j <= past + i), minus keys that are padding. Each query always attends to
    itself: a padding query would otherwise see no key at all, and its softmax over nothing
    gives NaN, which then reaches real tokens through ``0 * NaN`` in the value product. A
    padding position's output is never read, so letting it see itself changes nothing else.
    None when nothing needs masking (one new token and no padding).
    """
    if attention_mask is None and t == 1:
        return None
    q_pos = torch.arange(past, past + t, device=device).unsqueeze(1)
    k_pos = torch.arange(past + t, device=device).unsqueeze(0)
    allowed = (k_pos <= q_pos).unsqueeze(0)  # [1, t, S]
    if attention_mask is not None:
        allowed = (allowed & attention_mask.bool().unsqueeze(1)) | (k_pos == q_pos)
    return allowed.unsqueeze(1)


def check_generation_args(
    input_shape: tuple[int, int],
    past: int,
    *,
    labels: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    kv_cache: KVCache | None,
    logits_to_keep: int,
    num_layers: int,
) -> None:
    """Refuse generation inputs of ``GPT.forward`` that do not fit together.

    Raises:
        ValueError: naming the argument, its value and the fix.
    """
    b, t = input_shape
    if labels is not None and logits_to_keep:
        raise ValueError(
            f"GPT.forward: labels and logits_to_keep={logits_to_keep} do not combine: the "
            "loss needs the logits of every position"
        )
    if kv_cache is not None and len(kv_cache.layers) != num_layers:
        raise ValueError(
            f"GPT.forward: the KV cache has {len(kv_cache.layers)} layers, the model "
            f"{num_layers}; make it with GPT.new_kv_cache(max_len)"
        )
    if attention_mask is not None and tuple(attention_mask.shape) != (b, past + t):
        raise ValueError(
            f"GPT.forward: attention_mask has shape {tuple(attention_mask.shape)}, expected "
            f"{(b, past + t)} (batch, cached positions {past} + input length {t})"
        )


def check_generation_ready(model: nn.Module) -> None:
    """Refuse, before any work, a GPT whose attention layers cannot take a KV cache.

    Raises:
        ConfigError: an attention layer was swapped for one without the cache arguments
            (the INT8 attention core of ``slipstream.quant`` with ``HeroModes(attn_core=True)``).
    """
    layers: Any = model.get_submodule("layers")
    for i, layer in enumerate(layers):
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
