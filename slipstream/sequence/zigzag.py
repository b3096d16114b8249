"""The zig-zag layout of ring attention (:mod:`slipstream.sequence.ring`): which tokens each
rank holds, cutting batches and tensors to it and back, and document ids of packed rows."""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = [
    "check_length",
    "doc_starts",
    "sequence_shard_indices",
    "shard_batch_zigzag",
    "shard_sequence_zigzag",
    "unshard_sequence_zigzag",
]


def check_length(seq_len: int, ring_size: int, ulysses_size: int = 1) -> None:
    """Raise ``ValueError`` when ``seq_len`` cannot be split into ``2 * ring_size`` chunks
    whose pairs split again into ``ulysses_size`` parts."""
    if seq_len % (2 * ring_size) or (seq_len // ring_size) % ulysses_size:
        step = math.lcm(2 * ring_size, ring_size * ulysses_size)
        raise ValueError(
            f"ring attention: a sequence of {seq_len} tokens cannot be split into "
            f"{2 * ring_size} zig-zag chunks (ring size {ring_size}, Ulysses size "
            f"{ulysses_size}); pad it to a multiple of {step} (labels = -100 on the padding: "
            "slipstream.sequence.shard_causal_lm_batch_ring pads for you)"
        )


def sequence_shard_indices(
    seq_len: int, ring_size: int, sp_rank: int, ulysses_size: int = 1, device: Any = None
) -> torch.Tensor:
    """The global token indices (in order) held by ``sp_rank`` of ``ring_size * ulysses_size``
    ranks: ring piece ``i = sp_rank // ulysses_size`` (chunks ``i`` and ``2R-1-i``), part
    ``sp_rank % ulysses_size`` of it."""
    check_length(seq_len, ring_size, ulysses_size)
    chunk = seq_len // (2 * ring_size)
    i, j = divmod(sp_rank, ulysses_size)
    piece = torch.cat(
        [
            torch.arange(i * chunk, (i + 1) * chunk, device=device),
            torch.arange(
                (2 * ring_size - 1 - i) * chunk, (2 * ring_size - i) * chunk, device=device
            ),
        ]
    )
    part = piece.numel() // ulysses_size
    return piece[j * part : (j + 1) * part]


def shard_sequence_zigzag(
    x: torch.Tensor, ring_size: int, sp_rank: int, dim: int = 1, ulysses_size: int = 1
) -> torch.Tensor:
    """``sp_rank``'s tokens of ``x`` along ``dim`` (see :func:`sequence_shard_indices`)."""
    idx = sequence_shard_indices(x.shape[dim], ring_size, sp_rank, ulysses_size, x.device)
    return x.index_select(dim, idx)


def shard_batch_zigzag(
    batch: Any, sp_world_size: int, sp_rank: int, *, ring_size: int | None = None, seq_dim: int = 1
) -> Any:
    """Every tensor of ``batch`` (dicts, lists and tuples walked) cut to ``sp_rank``'s tokens
    along ``seq_dim`` in the zig-zag layout (ring of ``ring_size``, default all ranks; Ulysses
    degree ``sp_world_size // ring_size``); tensors with fewer dims are kept whole.

    Raises:
        ValueError: a length the layout cannot split (names the multiple to pad to).
    """
    ring = ring_size or sp_world_size
    if isinstance(batch, torch.Tensor):
        if batch.dim() <= seq_dim:
            return batch
        return shard_sequence_zigzag(batch, ring, sp_rank, seq_dim, sp_world_size // ring)
    if isinstance(batch, dict):
        return {
            k: shard_batch_zigzag(v, sp_world_size, sp_rank, ring_size=ring, seq_dim=seq_dim)
            for k, v in batch.items()
        }
    if isinstance(batch, (list, tuple)):
        items = [
            shard_batch_zigzag(v, sp_world_size, sp_rank, ring_size=ring, seq_dim=seq_dim)
            for v in batch
        ]
        return type(batch)(items) if isinstance(batch, list) else tuple(items)
    return batch


def unshard_sequence_zigzag(
    shards: list[torch.Tensor], ring_size: int, dim: int = 1, ulysses_size: int = 1
) -> torch.Tensor:
    """The inverse of :func:`shard_sequence_zigzag`: the full tensor from every rank's shard
    (in sp rank order)."""
    seq_len = sum(s.shape[dim] for s in shards)
    out = torch.empty_like(torch.cat(shards, dim))
    for rank, shard in enumerate(shards):
        idx = sequence_shard_indices(seq_len, ring_size, rank, ulysses_size, shard.device)
        out.index_copy_(dim, idx, shard)
    return out


def doc_starts(position_ids: torch.Tensor, token_index: torch.Tensor) -> torch.Tensor:
    """For packed rows whose position ids restart at 0 for each document: the global index
    of the first token of each token's document (``token_index - position_ids``); tokens
    attend only to tokens with the same value. ``token_index``: the global index of each
    position (``[S]`` or ``[B, S]``)."""
    return (token_index.to(position_ids.device) - position_ids).long()
