"""The blocks of ring attention (:mod:`slipstream.sequence.ring`): exact attention of one
query chunk against one key chunk with its log-sum-exp, forward and backward, and the
online-softmax merge. On CPU through PyTorch's fused kernel
(``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward); elsewhere a matmul
formula in tiles of :data:`ROW_TILE` query rows. Shapes: q ``[B, kv, g, n, D]``, k/v
``[B, kv, 1, c, D]`` (grouped-query heads), in the accumulation dtype."""

from __future__ import annotations

import torch

ROW_TILE = 1024
"""Query rows per score tile: a block's scores are computed ``ROW_TILE`` rows at a time, so
the transient score memory is ``ROW_TILE x S/(2R)`` per head, not ``(S/(2R))^2``."""


def _tiles(rows: int) -> list[tuple[int, int]]:
    return [(lo, min(rows, lo + ROW_TILE)) for lo in range(0, rows, ROW_TILE)]


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def _block_mask(
    qc: int,
    kc: int,
    causal: bool,
    q_doc: torch.Tensor | None,
    k_doc: torch.Tensor | None,
) -> tuple[bool, torch.Tensor | None, bool]:
    """``(skip, doc_mask, diagonal)``: whether the block has no allowed pair at all; the bool
    same-document mask ``[B, 1, 1, c, c]`` of packed rows (None without documents); whether
    it is a diagonal block under the causal mask (the causal triangle is never materialized
    for the fused kernel, and per row tile for the formula: :func:`tile_mask`)."""
    if causal and kc > qc:
        return True, None, False
    diagonal = causal and kc == qc
    if q_doc is None or k_doc is None:
        return False, None, diagonal
    same = (q_doc[:, :, None] == k_doc[:, None, :])[:, None, None]
    if diagonal:
        same = same & torch.ones(same.shape[-2:], dtype=torch.bool, device=same.device).tril()
    if not bool(same.any()):
        return True, None, False
    return False, same, diagonal


def tile_mask(
    doc_mask: torch.Tensor | None, diagonal: bool, lo: int, hi: int, cols: int, device: torch.device
) -> torch.Tensor | None:
    """The bool mask of query rows ``lo:hi`` of a block (None: every pair allowed)."""
    mask = None if doc_mask is None else doc_mask[..., lo:hi, :]
    if diagonal and mask is None:
        rows = torch.arange(lo, hi, device=device)[:, None]
        mask = rows >= torch.arange(cols, device=device)[None, :]
    return mask


def _scores(
    q: torch.Tensor, k: torch.Tensor, scale: float, mask: torch.Tensor | None
) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return s


def _block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[B, kv, g, c, D]``, k/v ``[B, kv, 1, c, D]`` (accumulation dtype): the block's
    normalized output and its log-sum-exp ``[B, kv, g, c]`` (-inf on rows with no key)."""
    s = _scores(q, k, scale, mask)
    lse = torch.logsumexp(s, dim=-1)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return torch.matmul(torch.exp(s - safe[..., None]), v), lse


_FLASH_CPU = hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


def _fused(q: torch.Tensor) -> bool:
    """Whether the blocks run PyTorch's fused CPU attention (O(c) memory, returns the
    log-sum-exp) rather than the tiled matmul formula (any device)."""
    return _FLASH_CPU and q.device.type == "cpu"


def _expand(k: torch.Tensor, groups: int) -> torch.Tensor:
    """``[B, kv, 1, c, D]`` -> ``[B, kv * groups, c, D]`` (each KV head for its query heads)."""
    b, kv, _, c, d = k.shape
    return k.expand(b, kv, groups, c, d).reshape(b, kv * groups, c, d)


def _fused_args(
    q: torch.Tensor, mask: torch.Tensor | None, diagonal: bool
) -> tuple[bool, torch.Tensor | None]:
    """``(is_causal, additive mask)`` for the fused kernel: a diagonal block without documents
    is its causal mode; a document mask (already causal on the diagonal) becomes
    ``[B, 1, c, c]`` of 0 / -inf."""
    if mask is None:
        return diagonal, None
    allowed = mask.reshape(mask.shape[0], 1, mask.shape[-2], mask.shape[-1])
    bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device)
    return False, bias.masked_fill(~allowed, float("-inf"))


def _fused_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None,
    diagonal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_block_forward` through ``aten._scaled_dot_product_flash_attention_for_cpu``."""
    b, kv, g, n, d = q.shape
    is_causal, bias = _fused_args(q, mask, diagonal)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.reshape(b, kv * g, n, d),
        _expand(k, g),
        _expand(v, g),
        0.0,
        is_causal,
        attn_mask=bias,
        scale=scale,
    )
    if bias is not None:  # rows with no key of their document here: no weight in the merge
        assert mask is not None
        rows = mask.reshape(mask.shape[0], 1, n, -1).any(-1)
        lse = lse.masked_fill(~rows, float("-inf"))
    return out.view(b, kv, g, n, d), lse.to(q.dtype).view(b, kv, g, n)


def _fused_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None,
    diagonal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A block's dq and (summed over query groups) dk, dv, given the *final* output and
    log-sum-exp of the rows (FlashAttention's backward recomputes the block's probabilities
    from them, so each block contributes its exact share)."""
    b, kv, g, n, d = q.shape
    c = k.shape[3]
    is_causal, bias = _fused_args(q, mask, diagonal)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out.reshape(b, kv * g, n, d),
        q.reshape(b, kv * g, n, d),
        _expand(k, g),
        _expand(v, g),
        out.reshape(b, kv * g, n, d),
        lse.reshape(b, kv * g, n),
        0.0,
        is_causal,
        attn_mask=bias,
        scale=scale,
    )
    return (
        dq.view(b, kv, g, n, d),
        dk.view(b, kv, g, c, d).sum(2, keepdim=True),
        dv.view(b, kv, g, c, d).sum(2, keepdim=True),
    )


def _merge(
    out: torch.Tensor, lse: torch.Tensor, blk_out: torch.Tensor, blk_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    new = torch.logaddexp(lse, blk_lse)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    out = out * torch.exp(lse - safe)[..., None] + blk_out * torch.exp(blk_lse - safe)[..., None]
    return out, new
