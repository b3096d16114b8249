"""Evaluation helpers: causal-LM perplexity and embedding cosine similarity."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["mean_cosine", "perplexity"]


@torch.no_grad()
def perplexity(
    model: nn.Module,
    ids: torch.Tensor,
    seq_len: int,
    logits_fn: Callable[..., torch.Tensor] | None = None,
) -> float:
    """Perplexity of ``model`` on a 1-D token stream ``ids``, over non-overlapping windows.

    ``logits_fn(model, window [1, T]) -> logits [1, T, V]`` adapts the call (default:
    ``model(window)``, or ``.logits`` of an HF output). Tokens predicted: ``T - 1`` per window.
    """
    total, count = 0.0, 0
    for start in range(0, ids.numel() - 1, seq_len):
        window = ids[start : start + seq_len].unsqueeze(0)
        if window.shape[1] < 2:
            break
        out = logits_fn(model, window) if logits_fn else model(window)
        logits = out if isinstance(out, torch.Tensor) else out.logits
        loss = F.cross_entropy(logits[0, :-1].float(), window[0, 1:], reduction="sum")
        total += loss.item()
        count += window.shape[1] - 1
    return math.exp(total / count)


def mean_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean cosine similarity of matching rows of two ``[n, d]`` embedding matrices."""
    return F.cosine_similarity(a.float(), b.float(), dim=-1).mean().item()
