"""Evoformer attention with DeepSpeed4Science's call shape, exact and memory-efficient.

``evoformer_attention(q, k, v, biases)`` computes, for every b, n, head h and query i::

    O[b,n,i,h] = sum_j softmax_j(Q[b,n,i,h] . K[b,n,j,h] / sqrt(D)
                                 + mask[b,n,0,0,j] + pair[b,0,h,i,j]) V[b,n,j,h]

the semantics of ``DS4Sci_EvoformerAttention`` (DeepSpeed4Science, Song et al. 2023,
arXiv 2310.04610, sec. "EvoformerAttention"). It is exact attention computed in query x key
tiles with an online softmax (see :mod:`slipstream.science._tiled`), in pure PyTorch, so it
runs on every device; the [B, N, H, L, L] logits are never materialised, and backward
recomputes them per tile from the saved output and log-sum-exp.

``evoformer_attention_reference`` is the naive formula (materialise logits, softmax, matmul),
the parity reference and the ``use_memory_efficient_kernel=False`` path of the modules.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from slipstream.science._tiled import Tiling, tiled_backward, tiled_forward

__all__ = [
    "DEFAULT_KV_TILE",
    "DEFAULT_N_TILE",
    "DEFAULT_Q_TILE",
    "evoformer_attention",
    "evoformer_attention_reference",
]

# Defaults from a sweep with ``benchmarks/evoformer.py --tiles`` (docs/evoformer.md): on a
# 2-core CPU at N=16-64, L=256-512, H=8, D=32, 128 x 128 x 4 was among the fastest configs
# and had the lowest peak; smaller tiles save little memory and cost time.
DEFAULT_Q_TILE = 128
"""Query rows per tile."""
DEFAULT_KV_TILE = 128
"""Key rows per tile."""
DEFAULT_N_TILE = 4
"""Entries of the broadcast axis N per step; bounds the tile temporaries independently of N."""

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_BIAS_NAMES = ("biases[0] (mask bias)", "biases[1] (pair bias)")


def _fmt(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"evoformer_attention: {name} must be a torch.Tensor, got {type(t)}")
        if t.dim() != 5:
            raise ValueError(
                f"evoformer_attention: {name} has shape {_fmt(t.shape)} ({t.dim()}-D); expected "
                "5-D [B, N, L, H, D] (batch, broadcast axis, attended axis, heads, head dim); "
                "unsqueeze or flatten leading dims to get exactly two"
            )
        if t.dtype not in _DTYPES:
            raise TypeError(
                f"evoformer_attention: {name} has dtype {t.dtype}; supported dtypes are "
                "float16, bfloat16, float32 and float64"
            )
    for name, t in (("k", k), ("v", v)):
        if t.shape != q.shape:
            raise ValueError(
                f"evoformer_attention: {name} has shape {_fmt(t.shape)}; expected the shape of "
                f"q, {_fmt(q.shape)} = [B, N, L, H, D]"
            )
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(
                f"evoformer_attention: {name} is {t.dtype} on {t.device} but q is {q.dtype} on "
                f"{q.device}; q, k and v must share dtype and device"
            )
    if min(q.shape) == 0:
        raise ValueError(f"evoformer_attention: q has an empty dimension, shape {_fmt(q.shape)}")


def _bias_error(index: int, bias: torch.Tensor, q: torch.Tensor) -> ValueError:
    b, n, length, h, _ = q.shape
    if index == 0:
        expected = f"[B, N, 1, 1, L] = {_fmt((b, n, 1, 1, length))} (B and N may be 1)"
    else:
        expected = f"[B, 1, H, L, L] = {_fmt((b, 1, h, length, length))} (B and H may be 1)"
    msg = f"evoformer_attention: {_BIAS_NAMES[index]} has shape {_fmt(bias.shape)}; expected {expected}"
    if index == 0 and tuple(bias.shape) == (b, length, 1, 1, n) and n != length:
        # DeepSpeed's tutorial writes the column-attention mask as [B, N_seq, 1, 1, N_res];
        # the kernel (and its shape assertion) needs it per key of the attended axis.
        msg += (
            ". This looks like a mask over the wrong axes (DeepSpeed's tutorial writes the "
            "column-attention mask as [B, N_seq, 1, 1, N_res]); for column attention "
            "q is [B, N_res, N_seq, H, D], so the mask must be [B, N_res, 1, 1, N_seq]"
        )
    return ValueError(msg)


def _check_biases(biases: Sequence[torch.Tensor | None] | None, q: torch.Tensor) -> list[Any]:
    """Validate ``biases``; returns a 2-list with None for absent biases."""
    if biases is None:
        return [None, None]
    if isinstance(biases, torch.Tensor) or len(biases) > 2:
        raise ValueError(
            "evoformer_attention: biases must be a list of at most 2 tensors (or None): "
            "[mask bias [B, N, 1, 1, L], pair bias [B, 1, H, L, L]]"
        )
    b, n, length, h, _ = q.shape
    allowed = (
        ((b, 1), (n, 1), (1,), (1,), (length,)),
        ((b, 1), (1,), (h, 1), (length,), (length,)),
    )
    padded = [*biases, None, None][:2]
    for index, bias in enumerate(padded):
        if bias is None:
            continue
        name = _BIAS_NAMES[index]
        if not isinstance(bias, torch.Tensor):
            raise TypeError(
                f"evoformer_attention: {name} must be a tensor or None, got {type(bias)}"
            )
        if not bias.is_floating_point() or bias.dtype not in _DTYPES:
            raise TypeError(
                f"evoformer_attention: {name} has dtype {bias.dtype}; biases are additive and "
                "floating point: turn a 0/1 mask into a bias with 1e9 * (mask - 1)"
            )
        if bias.device != q.device:
            raise ValueError(
                f"evoformer_attention: {name} is on {bias.device} but q is on {q.device}"
            )
        if bias.dim() != 5 or any(s not in ok for s, ok in zip(bias.shape, allowed[index])):
            raise _bias_error(index, bias, q)
    return padded


class _EvoformerAttentionFn(torch.autograd.Function):
    """Tiled forward; backward recomputes per tile from O and the log-sum-exp."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask_bias: torch.Tensor | None,
        pair_bias: torch.Tensor | None,
        tiling: Tiling,
    ) -> torch.Tensor:
        biases = [x for x in (mask_bias, pair_bias) if x is not None]
        compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        qt, kt, vt = (x.transpose(2, 3) for x in (q, k, v))
        out, lse = tiled_forward(qt, kt, vt, biases, tiling, compute_dtype)
        out = out.transpose(2, 3)
        ctx.save_for_backward(q, k, v, out, lse, *biases)
        ctx.has_bias = (mask_bias is not None, pair_bias is not None)
        ctx.tiling = tiling
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, *biases = ctx.saved_tensors
        needs = ctx.needs_input_grad
        bias_needs = [need for need, has in zip(needs[3:5], ctx.has_bias) if has]
        qt, kt, vt, ot, got = (x.transpose(2, 3) for x in (q, k, v, out, grad_out))
        dq, dk, dv, dbias = tiled_backward(qt, kt, vt, biases, ot, lse, got, bias_needs, ctx.tiling)
        grads = iter(dbias)
        mask_grad = next(grads) if ctx.has_bias[0] else None
        pair_grad = next(grads) if ctx.has_bias[1] else None
        return (
            dq.transpose(2, 3) if needs[0] else None,
            dk.transpose(2, 3) if needs[1] else None,
            dv.transpose(2, 3) if needs[2] else None,
            mask_grad,
            pair_grad,
            None,
        )


def evoformer_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    biases: Sequence[torch.Tensor | None] | None = None,
    *,
    q_tile: int = DEFAULT_Q_TILE,
    kv_tile: int = DEFAULT_KV_TILE,
    n_tile: int = DEFAULT_N_TILE,
) -> torch.Tensor:
    """Exact Evoformer attention with up to two additive biases, in tiles.

    Drop-in for DeepSpeed's ``DS4Sci_EvoformerAttention(Q, K, V, biases)``.

    Args:
        q, k, v: [B, N, L, H, D], one dtype (float16, bfloat16, float32 or float64) and
            device. N is the broadcast axis (sequences for MSA row attention, residues for
            column and triangle attention), L the attended axis. 1/sqrt(D) is applied here:
            do not pre-scale q.
        biases: ``[mask_bias, pair_bias]``, either may be None or left out:
            ``mask_bias`` broadcastable as [B, N, 1, 1, L] (per key; B and N may be 1),
            ``pair_bias`` as [B, 1, H, L, L] (B and H may be 1). Any floating dtype. A bias
            that requires grad gets its gradient summed over its broadcast axes.
        q_tile, kv_tile: query / key rows per tile (>= 1).
        n_tile: entries of the N axis per step (>= 1). Larger tiles cost more memory and,
            beyond cache size, time; results do not depend on tiles beyond rounding.

    Returns:
        [B, N, L, H, D] in q's dtype. A query whose every key has bias -inf has an empty
        softmax: its output is defined as 0 (and its gradients as 0) instead of NaN. Finite
        masks (OpenFold's -1e9) follow the formula exactly.

    Raises:
        TypeError / ValueError: wrong types, dtypes, devices or shapes; the message names the
            tensor, its shape and the expected shape.

    Memory: logits, probabilities and their gradients exist one [B, n_tile, H, q_tile,
    kv_tile] tile at a time; saved for backward are the inputs, the output and an fp32 (fp64 for
    fp64 inputs) log-sum-exp [B, N, H, L]. Tiles are computed in fp32 for 16-bit inputs.
    """
    _check_qkv(q, k, v)
    mask_bias, pair_bias = _check_biases(biases, q)
    for name, tile in (("q_tile", q_tile), ("kv_tile", kv_tile), ("n_tile", n_tile)):
        if not isinstance(tile, int) or isinstance(tile, bool) or tile < 1:
            raise ValueError(f"evoformer_attention: {name}={tile!r} must be an int >= 1")
    tiling = Tiling(q=q_tile, kv=kv_tile, n=n_tile)
    out: torch.Tensor = _EvoformerAttentionFn.apply(q, k, v, mask_bias, pair_bias, tiling)
    return out


def evoformer_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    biases: Sequence[torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """The naive formula: materialise [B, N, H, L, L] logits, softmax, multiply by V.

    Same arguments, checks and result as :func:`evoformer_attention`, computed in the input
    dtype with plain autograd (it holds the logits and probabilities, O(B*N*H*L*L) memory).
    Rows masked entirely with -inf give NaN here, as in the formula.
    """
    _check_qkv(q, k, v)
    qt, kt, vt = (x.transpose(2, 3) for x in (q, k, v))
    logits = torch.matmul(qt, kt.transpose(-1, -2)) * q.shape[-1] ** -0.5
    for bias in _check_biases(biases, q):
        if bias is not None:
            logits = logits + bias.to(logits.dtype)
    return torch.matmul(torch.softmax(logits, dim=-1), vt).transpose(2, 3)
