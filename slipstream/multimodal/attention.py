"""Multi-modal causal attention (MMCA), DeepSpeed-VisualChat's attention (Yao et al. 2023,
arXiv 2309.14327, sec. 3 and Figure 2 of the blog).

Every key and query carries a token type (0 = pad, 1 = text, 2 = image). MMCA changes only
the masking and the normalisation of causal attention, it adds no parameters:

* an image query attends only to itself (the vision encoder already mixed the patches of
  its image bidirectionally), so its output is its own value ``v_i``;
* a text query takes two separately normalised softmaxes, one over the earlier text keys
  (itself included) and one over the earlier image keys, and adds them:
  ``out_i = sum_{j in T_i} softmax_T(s_ij) v_j + sum_{j in I_i} softmax_I(s_ij) v_j``.
  Under one joint softmax the many text weights would crush the image weights; two
  softmaxes give each modality a full unit of attention.
* an empty modality contributes 0 (the paper is silent; this choice makes MMCA equal to
  standard causal attention when there are no image tokens); pad queries return 0 and pad
  keys get no weight.

``mode="reference_code"`` reproduces the released implementation instead (DeepSpeedExamples,
``applications/DeepSpeed-VisualChat``, the LLaMA attention with ``enable_mmca_attention``):
two additive masks built from ``finfo(dtype).min`` plus the causal mask, where doubly masked
entries overflow to ``-inf`` and singly masked ones stay finite. That arithmetic (i) gives
text before the first image a near-uniform "image" softmax over earlier text *and future
image tokens* (a causality leak), (ii) gives image queries their self weight 1 plus a text
softmax over earlier text (rows sum to 2), and (iii) applies the image-self rule only when
``Lq == Lk`` (the prompt pass). It is here to measure what the difference costs, not to use.
``mode="causal"`` is standard causal attention over the non-pad keys.

Cost: the paper mode runs two masked ``scaled_dot_product_attention`` calls (so the fused
CPU/GPU kernels apply) with two boolean masks of ``[B, 1, Lq, Lk]``; no ``[B, H, Lq, Lk]``
score tensor is kept for backward unless the kernel itself keeps one. With no image token in
the batch it is one call, and with no padding either it is the ``is_causal`` call of
standard attention, bit-identical to it.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F

__all__ = ["IMAGE", "PAD", "TEXT", "MMCAMode", "mmca_attention"]

MMCAMode = Literal["paper", "reference_code", "causal"]
PAD, TEXT, IMAGE = 0, 1, 2
_MODES = ("paper", "reference_code", "causal")


def _check(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, token_types: torch.Tensor, mode: str
) -> None:
    if mode not in _MODES:
        raise ValueError(f"mmca_attention: mode={mode!r} is unknown; use one of {_MODES}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"mmca_attention: q, k, v must be [B, H, L, D]; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    b, h, lq, d = q.shape
    if k.shape[:2] != v.shape[:2] or k.shape[2] != v.shape[2] or k.shape[0] != b:
        raise ValueError(
            f"mmca_attention: k {tuple(k.shape)} and v {tuple(v.shape)} must share batch, "
            f"kv heads and length with each other and batch {b} with q"
        )
    if k.shape[3] != d or h % k.shape[1]:
        raise ValueError(
            f"mmca_attention: q {tuple(q.shape)} and k {tuple(k.shape)} need the same head "
            f"dim and a query head count divisible by the kv head count (GQA)"
        )
    lk = k.shape[2]
    if token_types.shape != (b, lk) or token_types.dtype.is_floating_point:
        raise ValueError(
            f"mmca_attention: token_types must be an integer tensor [B, Lk] = {(b, lk)} "
            f"(0 pad, 1 text, 2 image, covering every key); got {token_types.dtype} "
            f"{tuple(token_types.shape)}"
        )
    if lq > lk:
        raise ValueError(
            f"mmca_attention: {lq} queries but only {lk} keys; the queries are the last Lq "
            "positions of the keys, so Lq <= Lk"
        )


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None,
    dropout_p: float,
) -> torch.Tensor:
    gqa = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=mask is None, scale=scale,
        enable_gqa=gqa,
    )  # fmt: skip


def _layout(token_types: torch.Tensor, lq: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query types ``[B, 1, Lq, 1]``, key types ``[B, 1, 1, Lk]`` and the causal relation
    ``[Lq, Lk]`` (query i sits at position ``Lk - Lq + i``)."""
    lk = token_types.shape[1]
    pos_q = torch.arange(lk - lq, lk, device=token_types.device)
    causal = torch.arange(lk, device=token_types.device)[None, :] <= pos_q[:, None]
    return token_types[:, -lq:][:, None, :, None], token_types[:, None, None, :], causal


def _diagonal(lq: int, lk: int, device: torch.device) -> torch.Tensor:
    """``[Lq, Lk]``: True where the key is the query's own position."""
    pos_q = torch.arange(lk - lq, lk, device=device)
    return torch.arange(lk, device=device)[None, :] == pos_q[:, None]


def _causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, types: torch.Tensor, scale: float | None,
    dropout_p: float,
) -> torch.Tensor:  # fmt: skip
    lq, lk = q.shape[2], k.shape[2]
    if lq == lk and bool((types != PAD).all()):
        return _sdpa(q, k, v, None, scale, dropout_p)
    tq, tk, causal = _layout(types, lq)
    real_q = tq != PAD
    # A pad query keeps its own key so that no row is empty (NaN in some kernels); its
    # output is zeroed below.
    mask = torch.where(real_q, causal & (tk != PAD), _diagonal(lq, lk, q.device))
    return _sdpa(q, k, v, mask, scale, dropout_p) * real_q


def _paper(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, types: torch.Tensor, scale: float | None,
    dropout_p: float,
) -> torch.Tensor:  # fmt: skip
    if not bool((types == IMAGE).any()):
        # No image keys: the image softmax is empty and contributes 0 (exactly).
        return _causal(q, k, v, torch.where(types == IMAGE, PAD, types), scale, dropout_p)
    lq, lk = q.shape[2], k.shape[2]
    tq, tk, causal = _layout(types, lq)
    text_q, diag = tq == TEXT, _diagonal(lq, lk, q.device)
    # Text queries: earlier text keys (itself included). Image queries: only themselves.
    # Pad queries: themselves, zeroed at the end.
    text_mask = torch.where(text_q, causal & (tk == TEXT), diag)
    image_mask = text_q & causal & (tk == IMAGE)
    has_image = image_mask.any(dim=-1, keepdim=True)
    image_mask = image_mask | (~has_image & diag)  # never an empty row; weighted by 0 below
    out = _sdpa(q, k, v, text_mask, scale, dropout_p)
    out = out + _sdpa(q, k, v, image_mask, scale, dropout_p) * has_image
    return out * (tq != PAD)


def _additive(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where ``keep``, ``finfo(dtype).min`` elsewhere (the released code's mask values)."""
    zero = torch.zeros((), dtype=dtype, device=keep.device)
    return torch.where(keep, zero, torch.finfo(dtype).min)


def _reference_code(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, types: torch.Tensor, scale: float | None
) -> torch.Tensor:
    """The released arithmetic, step for step (module docstring): masks added in the
    scores' dtype so that two ``finfo.min`` overflow to ``-inf``; softmaxes in at least fp32."""
    b, h, lq, d = q.shape
    lk, dtype = k.shape[2], q.dtype
    tq, tk, _ = _layout(types, lq)
    n_rep = h // k.shape[1]
    k = k.repeat_interleave(n_rep, dim=1)
    v = v.repeat_interleave(n_rep, dim=1)
    scores = (q @ k.transpose(-1, -2)) * (scale if scale is not None else 1.0 / math.sqrt(d))
    image_add = _additive(tk == IMAGE, dtype).expand(b, 1, lq, lk)
    if lq == lk:  # (iii) the image-self rule exists only in the prompt pass
        image_rows = _additive(_diagonal(lq, lk, q.device), dtype)
        image_add = torch.where(tq == IMAGE, image_rows, image_add)
    text_add = _additive(tk == TEXT, dtype)
    if lq > 1:  # the released code builds no causal mask for a single query
        causal_add = _additive(_layout(types, lq)[2], dtype)
        image_add, text_add = image_add + causal_add, text_add + causal_add
    soft = torch.promote_types(dtype, torch.float32)
    weights = F.softmax(scores + image_add, dim=-1, dtype=soft).to(dtype)
    weights = weights + F.softmax(scores + text_add, dim=-1, dtype=soft).to(dtype)
    return weights @ v


def mmca_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    token_types: torch.Tensor,
    mode: MMCAMode = "paper",
    *,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Multi-modal causal attention (module docstring).

    Args:
        q: queries ``[B, H, Lq, D]``: the last ``Lq`` positions of the sequence (``Lq < Lk``
            when decoding against a KV cache).
        k, v: keys and values ``[B, Hkv, Lk, D]``; ``H`` a multiple of ``Hkv`` (GQA: kv head
            ``j`` serves query heads ``j * H/Hkv ... (j + 1) * H/Hkv - 1``).
        token_types: ``[B, Lk]`` integers, 0 = pad, 1 = text, 2 = image, for every key; the
            last ``Lq`` entries are the queries' types.
        mode: "paper" (default), "reference_code" (the released arithmetic) or "causal".
        scale: score scale, default ``1 / sqrt(D)``.
        dropout_p: attention dropout (paper and causal modes).

    Returns:
        ``[B, H, Lq, D]``; rows of pad queries are 0 (except in "reference_code").

    Raises:
        ValueError: unknown mode, or shapes that do not fit together (named in the message).
    """
    _check(q, k, v, token_types, mode)
    if mode == "reference_code":
        return _reference_code(q, k, v, token_types, scale)
    if mode == "causal":
        return _causal(q, k, v, token_types, scale, dropout_p)
    return _paper(q, k, v, token_types, scale, dropout_p)
