"""Tile loops of the memory-efficient Evoformer attention (forward and backward).

Layout: the public tensors are [B, N, L, H, D]; these loops work on the [B, N, H, L, D]
*views* (``transpose(2, 3)``, no copy). A bias enters as a 5-D tensor already broadcastable to
the logits [B, N, H, L, L]: the mask bias as [B|1, N|1, 1, 1, L] and the pair bias as
[B|1, 1, H|1, L, L]; a tile of either is a plain slice, so no broadcast bias or logit tensor of
size B*N*H*L*L ever exists.

The method is FlashAttention's (Dao et al. 2022, sec. 3.1, algorithm 1; backward as in Dao
2023, FlashAttention-2, algorithm 2): for a query tile, loop over key tiles keeping a running
row maximum ``m``, normaliser ``l`` and unnormalised output ``acc`` (the online softmax of
Milakov & Gimelshein 2018). Only the output and the per-row log-sum-exp are kept for backward,
which recomputes the probabilities tile by tile.

Numerics: each tile is computed in ``compute_dtype`` (fp32 for fp16/bf16 inputs, the input
dtype otherwise). A row whose logits are all -inf (every key masked with -inf) has an empty
softmax; it is defined here as output 0, log-sum-exp -inf and zero gradients, where the naive
formula gives NaN. Finite mask values (OpenFold's -1e9) need no special case.

The broadcast axis N is processed in chunks of ``Tiling.n`` too, so the tile temporaries,
O(B * n * H * (q * kv + (q + kv) * D)), do not grow with N. Peak extra memory is that plus the
outputs (O; in backward dQ, dK, dV and the bias gradients, accumulated in ``compute_dtype``)
and the [B, N, H, L] log-sum-exp; for 16-bit inputs add fp32 copies of the current N chunk's
Q, K, V (and O, dO and its dQ accumulator in backward).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["Tiling", "tiled_backward", "tiled_forward"]


@dataclass(frozen=True)
class Tiling:
    """Tile sizes: query rows, key rows and entries of the broadcast axis N per step."""

    q: int
    kv: int
    n: int


def _tiles(length: int, tile: int) -> list[tuple[int, int]]:
    return [(start, min(start + tile, length)) for start in range(0, length, tile)]


def _logits(
    q_tile: torch.Tensor,
    k_tile: torch.Tensor,
    biases: list[torch.Tensor],
    rows: tuple[int, int],
    cols: tuple[int, int],
) -> torch.Tensor:
    """Logits of one tile: (q * scale) @ k^T + the bias tiles, [B, N, H, tq, tk]."""
    s = torch.matmul(q_tile, k_tile.transpose(-1, -2))
    for bias in biases:
        # A mask bias has one row (size 1 on the query axis); a pair bias has all of them.
        r = slice(None) if bias.shape[-2] == 1 else slice(*rows)
        s.add_(bias[..., r, cols[0] : cols[1]])  # in place: one tile-sized buffer per step
    return s


def _bias_chunk(bias: torch.Tensor, n0: int, n1: int) -> torch.Tensor:
    """The rows of ``bias`` for N entries [n0, n1) (all of it when broadcast over N)."""
    return bias if bias.shape[1] == 1 else bias[:, n0:n1]


def tiled_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    biases: list[torch.Tensor],
    tiling: Tiling,
    compute_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output and row log-sum-exp.

    Args:
        q, k, v: [B, N, H, L, D] (views are fine).
        biases: 5-D tensors broadcastable to [B, N, H, L, L] (see the module docstring).
        tiling: tile sizes.
        compute_dtype: dtype of the tile arithmetic and of the returned log-sum-exp.

    Returns:
        ``out`` [B, N, H, L, D] in ``q.dtype`` (a transposed view of a [B, N, L, H, D]
        tensor) and ``lse`` [B, N, H, L] in ``compute_dtype``.
    """
    b, n, h, length, d = q.shape
    out = q.new_empty(b, n, length, h, d).transpose(2, 3)
    lse = q.new_empty(b, n, h, length, dtype=compute_dtype)
    for n0, n1 in _tiles(n, tiling.n):
        _forward_chunk(
            q[:, n0:n1].to(compute_dtype),
            k[:, n0:n1].to(compute_dtype),
            v[:, n0:n1].to(compute_dtype),
            [_bias_chunk(bias, n0, n1) for bias in biases],
            out[:, n0:n1],
            lse[:, n0:n1],
            tiling,
        )
    return out, lse


def _forward_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    biases: list[torch.Tensor],
    out: torch.Tensor,
    lse: torch.Tensor,
    tiling: Tiling,
) -> None:
    """Online-softmax forward of one N chunk, written into ``out`` and ``lse``."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    kv_ranges = _tiles(q.shape[-2], tiling.kv)
    for rows in _tiles(q.shape[-2], tiling.q):
        qi = q[..., rows[0] : rows[1], :] * scale
        m = qi.new_full(qi.shape[:-1], -math.inf)
        l_sum = qi.new_zeros(qi.shape[:-1])
        acc = qi.new_zeros(qi.shape)
        for cols in kv_ranges:
            s = _logits(qi, k[..., cols[0] : cols[1], :], biases, rows, cols)
            m_new = torch.maximum(m, s.amax(dim=-1))
            # Rows with no finite logit so far keep m = -inf; shift them by 0 instead so
            # exp(-inf - (-inf)) never produces NaN (their p and alpha are 0 either way).
            shift = torch.where(torch.isneginf(m_new), 0.0, m_new)
            p = s.sub_(shift.unsqueeze(-1)).exp_()  # s is dead after this: reuse its buffer
            alpha = torch.exp(m - shift)
            l_sum = l_sum * alpha + p.sum(dim=-1)
            acc = acc * alpha.unsqueeze(-1) + torch.matmul(p, v[..., cols[0] : cols[1], :])
            m = m_new
        empty = l_sum == 0  # every key -inf: defined as output 0, lse -inf
        safe_l = torch.where(empty, 1.0, l_sum)
        out[..., rows[0] : rows[1], :] = (acc / safe_l.unsqueeze(-1)).to(out.dtype)
        lse[..., rows[0] : rows[1]] = torch.where(empty, -math.inf, m + torch.log(safe_l))


def _reduce_to(grad: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Sum ``grad`` over the axes where ``like`` has size 1 (its broadcast axes)."""
    dims = [i for i, size in enumerate(like.shape) if size == 1 and grad.shape[i] != 1]
    return grad.sum(dim=dims, keepdim=True) if dims else grad


def tiled_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    biases: list[torch.Tensor],
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    bias_needs_grad: list[bool],
    tiling: Tiling,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor | None]]:
    """Gradients of the attention for Q, K, V and each bias, recomputed tile by tile.

    Args:
        q, k, v, out, grad_out: [B, N, H, L, D] (views are fine).
        biases: as for :func:`tiled_forward`.
        lse: [B, N, H, L] from :func:`tiled_forward`; its dtype is the compute dtype.
        bias_needs_grad: one flag per bias; a False entry gets None.
        tiling: tile sizes (need not match the forward's).

    Returns:
        ``dq, dk, dv`` as [B, N, H, L, D] views of [B, N, L, H, D] tensors in the input
        dtype, and one gradient (bias shape and dtype) or None per bias. A bias gradient is
        ``dS`` = P * (dP - rowsum(dO * O)) summed over that bias's broadcast axes.
    """
    b, n, h, length, d = q.shape
    cdt = lse.dtype

    def new_grad(dtype: torch.dtype, entries: int) -> torch.Tensor:
        return q.new_zeros(b, entries, length, h, d, dtype=dtype).transpose(2, 3)

    # Rows with an empty softmax (lse -inf) get p = exp(s - inf) = 0, hence zero gradients.
    lse = torch.where(torch.isneginf(lse), math.inf, lse)
    dq, dk, dv = new_grad(q.dtype, n), new_grad(k.dtype, n), new_grad(v.dtype, n)
    dbias: list[torch.Tensor | None] = [
        torch.zeros(bias.shape, dtype=cdt, device=bias.device) if need else None
        for bias, need in zip(biases, bias_needs_grad)
    ]
    for n0, n1 in _tiles(n, tiling.n):
        # dq is accumulated over key tiles: in the compute dtype, cast once per chunk.
        dq_c = dq[:, n0:n1] if dq.dtype == cdt else new_grad(cdt, n1 - n0)
        _backward_chunk(
            [x[:, n0:n1].to(cdt) for x in (q, k, v, out, grad_out)],
            [_bias_chunk(bias, n0, n1) for bias in biases],
            lse[:, n0:n1],
            [dq_c, dk[:, n0:n1], dv[:, n0:n1]],
            [None if g is None else _bias_chunk(g, n0, n1) for g in dbias],
            tiling,
        )
        if dq_c.dtype != dq.dtype:
            dq[:, n0:n1] = dq_c
    grads = [None if g is None else g.to(bias.dtype) for g, bias in zip(dbias, biases)]
    return dq, dk, dv, grads


def _backward_chunk(
    tensors: list[torch.Tensor],
    biases: list[torch.Tensor],
    lse: torch.Tensor,
    grads: list[torch.Tensor],
    dbias: list[torch.Tensor | None],
    tiling: Tiling,
) -> None:
    """Backward of one N chunk: adds into ``grads`` (dq; dk, dv written) and ``dbias``."""
    q, k, v, out, grad_out = tensors
    dq, dk, dv = grads
    scale = 1.0 / math.sqrt(q.shape[-1])
    q_ranges = _tiles(q.shape[-2], tiling.q)
    # rowsum(dO * O): the softmax Jacobian's correction term, per query row.
    delta = torch.cat(
        [(grad_out[..., r0:r1, :] * out[..., r0:r1, :]).sum(-1) for r0, r1 in q_ranges], -1
    )
    for cols in _tiles(q.shape[-2], tiling.kv):
        kj, vj = k[..., cols[0] : cols[1], :], v[..., cols[0] : cols[1], :]
        dk_j, dv_j = torch.zeros_like(kj), torch.zeros_like(vj)
        for rows in q_ranges:
            qi = q[..., rows[0] : rows[1], :] * scale
            do_i = grad_out[..., rows[0] : rows[1], :]
            s = _logits(qi, kj, biases, rows, cols)
            p = s.sub_(lse[..., rows[0] : rows[1]].unsqueeze(-1)).exp_()
            dv_j += torch.matmul(p.transpose(-1, -2), do_i)
            dp = torch.matmul(do_i, vj.transpose(-1, -2))
            ds = dp.sub_(delta[..., rows[0] : rows[1]].unsqueeze(-1)).mul_(p)
            dq[..., rows[0] : rows[1], :] += torch.matmul(ds, kj) * scale
            dk_j += torch.matmul(ds.transpose(-1, -2), qi)  # qi already carries the scale
            _accumulate_bias_grads(ds, biases, dbias, rows, cols)
        dk[..., cols[0] : cols[1], :] = dk_j
        dv[..., cols[0] : cols[1], :] = dv_j


def _accumulate_bias_grads(
    ds: torch.Tensor,
    biases: list[torch.Tensor],
    dbias: list[torch.Tensor | None],
    rows: tuple[int, int],
    cols: tuple[int, int],
) -> None:
    for bias, grad in zip(biases, dbias):
        if grad is None:
            continue
        r = slice(None) if bias.shape[-2] == 1 else slice(*rows)
        grad[..., r, cols[0] : cols[1]] += _reduce_to(ds, bias)
