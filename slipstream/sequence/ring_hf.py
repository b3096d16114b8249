"""Ring attention (and Ulysses x ring) for Hugging Face causal LMs, through transformers'
attention-function registry as :mod:`slipstream.sequence.hf` installs Ulysses.

What changes against Ulysses (see :mod:`slipstream.sequence.ring` for the layout):

* the batch is cut zig-zag (:func:`shard_causal_lm_batch_ring`): labels shifted on the full
  sequence, position ids of the full sequence (given or ``0..S-1``), then each rank keeps
  its tokens. A length that does not split is padded on the right to the next multiple
  (padding tokens: id 0, label -100, positions continuing the last document; they sit after
  every real token, so under the causal mask no real token sees them and the loss ignores
  them: the result is the unpadded one);
* the attention function runs :func:`~slipstream.sequence.ring.usp_attention_heads_first`
  instead of the model's core (sdpa/eager are not called; the ring computes exact attention
  itself). Packed rows (position ids restarting at 0 per document) attend within their
  document: a forward pre-hook reads the position ids, and when any rank of the group sees a
  restart (one scalar all-reduce per forward) every layer masks across documents;
* the loss is the global token mean over the shards, as for Ulysses.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from slipstream.distributed import comm
from slipstream.sequence.hf import (
    Packing,
    _check_causal_lm,
    _sp_loss,
    full_sequence_fields,
    publish_packing,
    refuse_kernel_gaps,
)
from slipstream.sequence.ring import (
    check_usp_heads,
    doc_starts,
    sequence_shard_indices,
    usp_attention_heads_first,
)

__all__ = ["install_hf_ring_", "ring_hf_attention", "shard_causal_lm_batch_ring"]

_NAMES = itertools.count()


def _padded_length(s: int, ring: int, ulysses: int) -> int:
    """The smallest length >= ``s`` that the zig-zag layout splits."""
    step = math.lcm(2 * ring, ring * ulysses)
    return -(-s // step) * step


def shard_causal_lm_batch_ring(
    batch: dict[str, Any],
    sp_world_size: int,
    sp_rank: int,
    *,
    ring_size: int | None = None,
    ignore_index: int = -100,
) -> dict[str, Any]:
    """This rank's zig-zag part of a causal-LM batch (see the module docs).

    ``ring_size`` defaults to ``sp_world_size`` (pure ring); the Ulysses degree is
    ``sp_world_size // ring_size``. Labels become ``shift_labels`` (and ``labels``) shifted
    on the full sequence; ``position_ids`` are kept (packed rows) or made ``0..S-1``.

    Raises:
        ValueError: an ``attention_mask`` with padding (mark padding with labels = -100).
    """
    ring = ring_size or sp_world_size
    ulysses = sp_world_size // ring
    ids = batch["input_ids"]
    b, s = ids.shape[0], ids.shape[1]
    out = full_sequence_fields(
        batch, ids, ignore_index, "ring",
        " (or pack documents with position ids restarting at 0)",
    )  # fmt: skip
    full = _padded_length(s, ring, ulysses)
    pad = full - s
    idx = sequence_shard_indices(full, ring, sp_rank, ulysses, ids.device)
    for key, value in list(out.items()):
        if not (isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == s):
            continue
        if pad:
            if key == "position_ids":
                tail = value[:, -1:] + torch.arange(1, pad + 1, device=value.device)
                value = torch.cat([value, tail], dim=1)
            else:
                fill = ignore_index if key in ("labels", "shift_labels") else 0
                value = torch.cat([value, value.new_full((b, pad, *value.shape[2:]), fill)], 1)
        out[key] = value.index_select(1, idx).contiguous()
    return out


def _pre_hook(
    sp_group: comm.Group, ring: int, ulysses: int, packing: Packing
) -> Callable[..., Any]:
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        mask = kwargs.get("attention_mask")
        if mask is not None:
            if mask.dim() != 2 or not bool(mask.all()):
                raise ValueError(
                    "sequence parallelism (ring): an attention_mask with padding (or a 4-D "
                    "mask) cannot be applied to sequence shards; drop attention_mask and mark "
                    "padded positions with labels = -100 (pack documents with position ids "
                    "restarting at 0)"
                )
            kwargs["attention_mask"] = None
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        if ids is None:
            return args, kwargs
        local = ids.shape[1]
        p = comm.get_world_size(sp_group)
        rank = comm.get_rank(sp_group)
        index = sequence_shard_indices(local * p, ring, rank, ulysses, ids.device)
        pos = kwargs.get("position_ids")
        if pos is None:
            pos = index.unsqueeze(0).expand(ids.shape[0], -1)
            kwargs["position_ids"] = pos
        publish_packing(doc_starts(pos, index), sp_group, packing, label="sp.ring_packed")
        kwargs.setdefault("use_cache", False)
        return args, kwargs

    return hook


def ring_hf_attention(
    ulysses_group: comm.Group, ring_group: comm.Group, packing: Packing
) -> Callable[..., tuple[torch.Tensor, Any]]:
    """A transformers attention function running Ulysses x ring attention (``query``
    ``[B, H, S/P, D]``, ``key``/``value`` ``[B, kv, S/P, D]`` of this rank's tokens; returns
    ``([B, S/P, H, D], None)``)."""

    def attention(
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        *args: Any,
        dropout: float = 0.0,
        scaling: float | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Any]:
        refuse_kernel_gaps(
            module, dropout, kwargs, "ring attention", "use sequence_parallel_mode 'ulysses'"
        )
        out = usp_attention_heads_first(
            query,
            key,
            value,
            ulysses_group,
            ring_group,
            causal=True,
            scale=scaling,
            doc_start=packing.doc,
        )
        return out.transpose(1, 2), None

    attention._slipstream_ulysses = True  # type: ignore[attr-defined]
    return attention


def install_hf_ring_(
    model: nn.Module,
    sp_group: comm.Group,
    ulysses_group: comm.Group,
    ring_group: comm.Group,
    tp_size: int = 1,
) -> str:
    """Make a transformers causal LM train on zig-zag sequence shards over ``sp_group``
    (Ulysses over ``ulysses_group`` inside ring steps over ``ring_group``), in place.

    Registers the attention function under a new name and points the config at it, sets the
    sharded loss, and adds the pre-hook (positions, packing, mask refusal).
    ``slipstream.initialize`` calls this for ``sequence_parallel_mode: "ring"``.
    ``tp_size``: the tensor-parallel degree the model is already split over (the Ulysses
    degree must split each TP rank's ``heads / tp_size`` heads; pure ring takes any count).

    Returns:
        The attention name the model uses.
    Raises:
        ValueError: not a causal LM, or heads the Ulysses degree cannot split.
    """
    from transformers import AttentionInterface

    _check_causal_lm(model)
    config: Any = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = int(text.num_attention_heads)
    kv = int(getattr(text, "num_key_value_heads", None) or heads)
    ring = comm.get_world_size(ring_group)
    ulysses = comm.get_world_size(ulysses_group)
    message = check_usp_heads(heads // tp_size, kv // tp_size, ulysses)
    if message is not None and tp_size > 1:
        message += (
            f" (counts per TP rank: tensor_parallel.autotp_size={tp_size} splits "
            f"num_attention_heads={heads}, num_key_value_heads={kv})"
        )
    if message is not None:
        raise ValueError(f"{type(model).__name__}: {message}")
    packing = Packing()
    name = f"slipstream_ring_{next(_NAMES)}"
    AttentionInterface.register(name, ring_hf_attention(ulysses_group, ring_group, packing))
    config._attn_implementation = name
    model.loss_function = _sp_loss(sp_group)  # type: ignore[assignment]
    model.register_forward_pre_hook(_pre_hook(sp_group, ring, ulysses, packing), with_kwargs=True)
    return name
