"""A key/value cache for the reference GPT's generation: one preallocated buffer per layer.

Decoding token ``t`` needs the keys and values of tokens ``0..t-1`` at every layer; keeping
them turns each step from a forward over the whole sequence into a forward over one token.
Each layer's buffer is ``[batch, kv_heads, max_len, head_dim]``, written in place at the next
free columns, so a step copies only the new token's keys and values (a growing
``torch.cat`` would copy the whole cache every step).

The buffers are allocated at the first write, from the keys' own shape, dtype and device:
the cache never needs the model's head counts, so a tensor-parallel rank, whose attention
holds ``kv_heads / tp`` heads, gets buffers of its local size without being told.
"""

from __future__ import annotations

import torch

__all__ = ["KVCache", "LayerKV"]


class LayerKV:
    """The cached keys and values of one attention layer."""

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self.length = 0
        """Positions written so far."""
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``k``, ``v`` ``[b, kv_heads, t, head_dim]``; return all keys and values so
        far, ``[b, kv_heads, length, head_dim]`` (views of the buffers).

        Raises:
            ValueError: the cache would grow past ``max_len``, or the batch or head shape
                differs from the one the buffers were made for.
        """
        start, end = self.length, self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(
                f"KV cache: writing positions {start}..{end - 1} past its max_len={self.max_len}; "
                "make the cache for the prompt plus all new tokens"
            )
        if self.keys is None or self.values is None:
            shape = (k.shape[0], k.shape[1], self.max_len, k.shape[3])
            self.keys = torch.empty(shape, dtype=k.dtype, device=k.device)
            self.values = torch.empty(shape, dtype=v.dtype, device=v.device)
        elif k.shape[:2] != self.keys.shape[:2]:
            raise ValueError(
                f"KV cache: keys of shape {tuple(k.shape)} do not fit the cache's batch and "
                f"heads {tuple(self.keys.shape[:2])}; use one cache per batch"
            )
        self.keys[:, :, start:end] = k
        self.values[:, :, start:end] = v
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only batch ``rows`` (a finished sequence leaves the batch)."""
        if self.keys is not None and self.values is not None:
            self.keys = self.keys.index_select(0, rows)
            self.values = self.values.index_select(0, rows)


class KVCache:
    """Keys and values of every layer of a GPT, for up to ``max_len`` positions.

    Pass it as ``GPT.forward(..., kv_cache=cache)``: the forward reads ``length`` (positions
    already cached) and each attention layer appends its new keys and values.
    """

    def __init__(self, num_layers: int, max_len: int) -> None:
        if num_layers < 1 or max_len < 1:
            raise ValueError(
                f"KVCache(num_layers={num_layers}, max_len={max_len}): both must be >= 1"
            )
        self.layers = [LayerKV(max_len) for _ in range(num_layers)]
        self.max_len = max_len

    @property
    def length(self) -> int:
        """Positions cached so far (the next input starts at this position)."""
        return self.layers[0].length

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only batch ``rows`` of every layer, in place."""
        for layer in self.layers:
            layer.select_rows(rows)
