"""Grouped GEMM: several matrices, each applied to its own consecutive block of rows.

``torch._grouped_mm`` (one kernel for all groups) where the build has it and the operands are
16-byte aligned; else the rows are padded to the longest group and multiplied with one
batched GEMM. Both have autograd.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["grouped_mm"]


def _aligned(t: Tensor) -> bool:
    """16-byte aligned start and strides (a transposed operand has one unit stride)."""
    size = t.element_size()
    return t.data_ptr() % 16 == 0 and all(s == 1 or (s * size) % 16 == 0 for s in t.stride())


def _contiguous_grad(t: Tensor) -> Tensor:
    # torch._grouped_mm's CPU backward rejects expanded (stride-0) incoming gradients.
    if t.requires_grad:
        t.register_hook(lambda g: g.contiguous())
    return t


def grouped_mm(x: Tensor, w: Tensor, counts: Tensor) -> Tensor:
    """``x [n, i]`` rows ``counts[0]`` for group 0, then group 1, ... times ``w [g, i, o]``.

    One ``torch._grouped_mm`` when available and the operands are 16-byte aligned; else the
    rows are padded to the largest group and multiplied with one batched GEMM.
    """
    if hasattr(torch, "_grouped_mm") and x.shape[0] and _aligned(x) and _aligned(w):
        offs = torch.cumsum(counts, 0).to(torch.int32)
        return _contiguous_grad(torch._grouped_mm(x, w, offs=offs))
    return _padded_bmm(x, w, counts)


def _padded_bmm(x: Tensor, w: Tensor, counts: Tensor) -> Tensor:
    groups = w.shape[0]
    longest = int(counts.max()) if counts.numel() else 0
    starts = torch.cumsum(counts, 0) - counts
    group = torch.repeat_interleave(torch.arange(groups, device=x.device), counts)
    pos = torch.arange(x.shape[0], device=x.device) - starts[group]
    padded = x.new_zeros(groups, longest, x.shape[1])
    padded = padded.index_put((group, pos), x)
    return torch.bmm(padded, w)[group, pos]
