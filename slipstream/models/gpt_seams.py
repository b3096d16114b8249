"""The reference GPT's parameter-free seams, which parallel plans replace from outside.

Each attention's ``core`` (:class:`CausalAttention`), the model's ``positions``
(:class:`FullSequence`, a :class:`SequenceSpan`) and its ``output`` (:class:`LMOutput`):
``slipstream.models.gpt_plans`` swaps in sequence- and tensor-parallel versions.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["CausalAttention", "FullSequence", "LMOutput", "SequenceSpan"]


class CausalAttention(nn.Module):
    """``softmax(q k^T / sqrt(D)) v`` with a causal mask over the local sequence: an
    attention's core, which a sequence-parallel plan replaces.

    ``forward(q, k, v)``: rotated queries ``[B, H, T, D]``, keys and values ``[B, kv, T, D]``
    (each kv head serves ``H / kv`` consecutive query heads); returns ``[B, T, H, D]``.
    """

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.dropout = dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n_rep = q.shape[1] // k.shape[1]
        if n_rep > 1:  # GQA: each kv head serves n_rep consecutive query heads.
            k = k.repeat_interleave(n_rep, dim=1)
            v = v.repeat_interleave(n_rep, dim=1)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        return y.transpose(1, 2)


class SequenceSpan(Protocol):
    """Where a model's input sits in the full sequence (the ``positions`` seam)."""

    def span(self, length: int) -> tuple[int, int]:
        """``(start, total)``: the input's first position and the full sequence length."""
        ...


class FullSequence(nn.Module):
    """Where the input sits in the sequence: all of it, from position 0 (single device; a
    sequence-parallel plan swaps in a sharded version)."""

    def span(self, length: int) -> tuple[int, int]:
        """``(start, total)``: the input's first position and the full sequence length."""
        return 0, length


class LMOutput(nn.Module):
    """The model's last step: the logits when ``labels`` is None, else the mean token
    cross-entropy in fp32 (-100 ignored). Parallel plans swap in versions for sharded logits."""

    def forward(self, logits: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if labels is None:
            return logits
        # fp32 upcast: a bf16 log-softmax over the vocabulary loses too much precision.
        return F.cross_entropy(
            logits.float().view(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100
        )
