"""A paged KV cache: fixed-size blocks in one preallocated pool per layer, a block table per
sequence, reference-counted blocks (Kwon et al. 2023, vLLM's PagedAttention).

A sequence's keys and values live in blocks of ``block_size`` positions taken from a shared
pool; its *block table* lists them in order, so position ``p`` sits in slot
``table[p // block_size] * block_size + p % block_size`` of every layer's pool. Nothing is
allocated per request: a finished, aborted or preempted sequence hands its blocks back to the
:class:`BlockAllocator` and the next one reuses them, so memory is bounded by the pool and
never fragments.

Blocks are reference counted: the ``n`` samples of one prompt (GRPO's group, best-of-n) fork
the prompt's block table instead of computing and storing the prompt ``n`` times. Full prompt
blocks are never written again, so they stay shared; the last, partly filled block is copied
the first time a sample writes into it (copy-on-write, :meth:`PagedKVCache.writable`).

Attention over the block table (:meth:`PagedKVCache.attend`) writes the step's new keys and
values into their slots, gathers each sequence's slots into a dense ``[batch, kv_heads,
length, head_dim]`` tensor and runs PyTorch's ``scaled_dot_product_attention`` on it: all
decoding sequences of a step in one call (shorter ones masked), each prefill chunk in one
call with a causal mask offset by the positions already cached. The same code runs on CPU and
CUDA (no paged kernel: the gather is one ``index_select`` per layer and step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

__all__ = ["AttentionGroup", "BlockAllocator", "NoFreeBlocks", "PagedKVCache", "StepLayout"]


class NoFreeBlocks(RuntimeError):
    """The pool has no free block (the scheduler preempts a sequence and retries)."""


class BlockAllocator:
    """Free list and reference counts of ``num_blocks`` blocks."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"BlockAllocator: num_blocks={num_blocks} must be >= 1")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out block 0 first
        self.refcount = [0] * num_blocks

    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """A free block, with one reference.

        Raises:
            NoFreeBlocks: every block is in use.
        """
        if not self._free:
            raise NoFreeBlocks("no free KV-cache block")
        block = self._free.pop()
        self.refcount[block] = 1
        return block

    def share(self, block: int) -> None:
        """One more sequence uses ``block`` (a forked prefix)."""
        if self.refcount[block] < 1:
            raise ValueError(f"BlockAllocator: block {block} is free; cannot share it")
        self.refcount[block] += 1

    def free(self, block: int) -> None:
        """Drop one reference; the block returns to the free list at zero."""
        if self.refcount[block] < 1:
            raise ValueError(f"BlockAllocator: block {block} freed twice")
        self.refcount[block] -= 1
        if self.refcount[block] == 0:
            self._free.append(block)


@dataclass
class AttentionGroup:
    """Queries of one ``scaled_dot_product_attention`` call: ``batch`` sequences of
    ``q_len`` consecutive flat tokens each, starting at flat token ``start``."""

    start: int
    batch: int
    q_len: int
    gather: torch.Tensor
    """``[batch, keys]`` pool slots of each sequence's keys (padding slots are masked)."""
    mask: torch.Tensor | None
    """``[batch, 1, q_len, keys]`` bool, True where a query may attend a key; None: all."""


@dataclass
class StepLayout:
    """Where one step's flat tokens go in the cache and whom they attend (built once per step,
    used by every layer)."""

    slots: torch.Tensor
    """``[tokens]`` pool slot each new token's key and value is written to."""
    groups: list[AttentionGroup] = field(default_factory=list)


class PagedKVCache:
    """The pools (``[num_blocks * block_size, kv_heads, head_dim]`` keys and values per
    layer) and the allocator that hands out their blocks."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"PagedKVCache: block_size={block_size} must be >= 1")
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        shape = (num_blocks * block_size, kv_heads, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.device = device
        self.layout: StepLayout | None = None

    # ---- block tables -------------------------------------------------------------------

    def blocks_for(self, length: int) -> int:
        """Blocks that hold ``length`` positions."""
        return -(-length // self.block_size)

    def grow(self, table: list[int], length: int) -> None:
        """Append blocks to ``table`` until it holds ``length`` positions; on
        :class:`NoFreeBlocks` the blocks taken by this call are given back first."""
        taken = []
        try:
            while len(table) * self.block_size < length:
                taken.append(self.allocator.allocate())
                table.append(taken[-1])
        except NoFreeBlocks:
            for block in taken:
                table.pop()
                self.allocator.free(block)
            raise

    def writable(self, table: list[int], start: int, end: int) -> bool:
        """Make the blocks of positions ``start..end-1`` private to this table: a shared one
        (refcount > 1) is copied into a fresh block first (copy-on-write). Returns whether
        the table changed."""
        refs, changed = self.allocator.refcount, False
        for i in range(start // self.block_size, self.blocks_for(end)):
            if refs[table[i]] > 1:
                fresh = self.allocator.allocate()
                self._copy_block(table[i], fresh)
                self.allocator.free(table[i])
                table[i], changed = fresh, True
        return changed

    def fork(self, table: list[int]) -> list[int]:
        """A new table sharing every block of ``table`` (one more reference each)."""
        for block in table:
            self.allocator.share(block)
        return list(table)

    def release(self, table: list[int]) -> None:
        """Drop ``table``'s references (its sequence finished, aborted or was preempted)."""
        for block in table:
            self.allocator.free(block)
        table.clear()

    def _copy_block(self, src: int, dst: int) -> None:
        bs = self.block_size
        for pool in (*self.keys, *self.values):
            pool[dst * bs : (dst + 1) * bs] = pool[src * bs : (src + 1) * bs]

    def slots(self, table: list[int], start: int, end: int) -> list[int]:
        """Pool slots of positions ``start..end-1`` of a sequence with block table ``table``."""
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    # ---- one step ------------------------------------------------------------------------

    def plan(self, decodes: list[list[int]], chunks: list[tuple[list[int], int]]) -> StepLayout:
        """The layout of a step whose flat tokens are one token of each decoding sequence
        (each given by the pool slots of all its positions, the new token's last), then each
        prefill chunk (``(slots, start)``: the slots of positions ``0..end-1``, of which
        ``start..end-1`` are new), in that order."""
        dev = self.device
        slots: list[int] = []
        groups: list[AttentionGroup] = []
        if decodes:
            lengths = [len(row) for row in decodes]
            width = max(lengths)
            slots.extend(row[-1] for row in decodes)
            rows = [row + [0] * (width - len(row)) for row in decodes]
            mask = None
            if min(lengths) != width:
                keys = torch.arange(width, device=dev)
                lens = torch.tensor(lengths, device=dev)
                mask = (keys.unsqueeze(0) < lens.unsqueeze(1)).view(len(rows), 1, 1, width)
            gather = torch.tensor(rows, dtype=torch.long, device=dev)
            groups.append(AttentionGroup(0, len(rows), 1, gather, mask))
        for row, start in chunks:
            end, first = len(row), len(slots)
            slots.extend(row[start:])
            q_pos = torch.arange(start, end, device=dev).unsqueeze(1)
            mask = (torch.arange(end, device=dev).unsqueeze(0) <= q_pos).view(
                1, 1, end - start, end
            )
            gather = torch.tensor([row], dtype=torch.long, device=dev)
            groups.append(AttentionGroup(first, 1, end - start, gather, mask))
        return StepLayout(torch.tensor(slots, dtype=torch.long, device=dev), groups)

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None
    ) -> torch.Tensor:
        """Attention of this step's flat queries ``q [tokens, heads, head_dim]`` (rotated)
        over the cache, after writing the new ``k``, ``v`` ``[tokens, kv_heads, head_dim]``
        into their slots; returns ``[tokens, heads, head_dim]``."""
        layout = self.layout
        if layout is None:
            raise RuntimeError("PagedKVCache.attend outside a step (no layout planned)")
        kp, vp = self.keys[layer], self.values[layer]
        kp.index_copy_(0, layout.slots, k.to(kp.dtype))
        vp.index_copy_(0, layout.slots, v.to(vp.dtype))
        heads, dim = q.shape[1], q.shape[2]
        outs = []
        for g in layout.groups:
            n = g.batch * g.q_len
            qg = q[g.start : g.start + n].view(g.batch, g.q_len, heads, dim).transpose(1, 2)
            kg = kp[g.gather].to(q.dtype).transpose(1, 2)  # [batch, kv_heads, keys, dim]
            vg = vp[g.gather].to(q.dtype).transpose(1, 2)
            y = F.scaled_dot_product_attention(
                qg, kg, vg, attn_mask=g.mask, scale=scale, enable_gqa=heads != kg.shape[1]
            )
            outs.append(y.transpose(1, 2).reshape(n, heads, dim))
        return outs[0] if len(outs) == 1 else torch.cat(outs)
