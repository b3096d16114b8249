"""Vectorized-PyTorch HEAT step: closed-form gradients from reused dot products, no autograd.

The candidate the numba kernel was measured against (see ``docs/heat.md``) and the
backend used when numba is not installed. A batch of ``B`` samples is one vectorized
step: dot products ``h·h``, ``h·e_k``, ``e_k·e_k`` are computed once and reused for the
gradients (HEAT §4.3), and only touched rows are updated with ``index_add_`` (§4.4).
Unlike the numba kernel it gathers the candidate rows into a ``[B, n+1, K]`` block.
"""

from __future__ import annotations

import torch

from slipstream.recsys.config import SimpleXConfig
from slipstream.recsys.model import COSINE_EPS

__all__ = ["torch_heat_step"]


def torch_heat_step(
    params: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    history: tuple[torch.Tensor, torch.Tensor],
    batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    cfg: SimpleXConfig,
    scale: float,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> float:
    """Add ``scale * (sum of per-sample gradients)`` of ``batch`` into ``out``.

    Args:
        params: ``(U [n_u, K], V [n_i, K], W [K, K])``, read only.
        history: ``(hist_pad [n_u, L], hist_mask [n_u, L])`` of :class:`SimpleX`.
        batch: ``(users [B], pos [B], negs [B, n])`` int64.
        cfg: loss hyper-parameters.
        scale: ``-lr`` for SGD (with ``out is params``), ``1/B`` for a mean gradient.
        out: ``(outU, outV, outW)`` receiving the scaled gradient (may alias ``params``).

    Returns:
        The summed loss of the batch (before the update).
    """
    U, V, W = params
    users, pos, negs = batch
    g, n_neg, l2 = cfg.gate, negs.shape[1], cfg.l2
    e_u = U[users]
    if g < 1.0:
        idx = history[0][users]
        mask = history[1][users].to(U.dtype)
        count = mask.sum(1, keepdim=True)
        p = torch.einsum("bl,blk->bk", mask, V[idx]) / count.clamp_min(1.0)
        h = g * e_u + (1.0 - g) * (p @ W.T)
    else:
        h = e_u
    cand = torch.cat([pos.unsqueeze(1), negs], 1)
    E = V[cand]
    a = (h * h).sum(1, keepdim=True)
    b = (E * E).sum(2)
    na, nb = a.sqrt().clamp_min(COSINE_EPS), b.sqrt().clamp_min(COSINE_EPS)
    cos = torch.einsum("bk,bnk->bn", h, E) / (na * nb)
    d = (cos > cfg.margin).to(U.dtype) * (cfg.negative_weight / n_neg)
    d[:, 0] = -1.0
    loss = (1.0 - cos[:, 0]).sum() + (d[:, 1:] * (cos[:, 1:] - cfg.margin)).sum()
    loss = loss + l2 * (b.sum() + (e_u * e_u).sum())
    f = d / (na * nb)
    gh = torch.einsum("bn,bnk->bk", f, E)
    gh -= h * torch.where(a > COSINE_EPS**2, (d * cos).sum(1, keepdim=True) / a, 0.0)
    c2 = 2.0 * l2 - torch.where(nb > COSINE_EPS, d * cos / (nb * nb), 0.0)
    gE = f.unsqueeze(-1) * h.unsqueeze(1) + c2.unsqueeze(-1) * E
    outU, outV, outW = out
    if g < 1.0:
        gp = ((1.0 - g) * scale) * (gh @ W) / count.clamp_min(1.0)
        gW = ((1.0 - g) * scale) * (gh.T @ p)
        outV.index_add_(0, idx.reshape(-1), (mask.unsqueeze(-1) * gp.unsqueeze(1)).flatten(0, 1))
        outW += gW
    outV.index_add_(0, cand.reshape(-1), (scale * gE).flatten(0, 1))
    outU.index_add_(0, users, scale * (g * gh + 2.0 * l2 * e_u))
    return float(loss)
