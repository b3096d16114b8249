"""DeepSpeed-Ulysses sequence parallelism (Jacobs et al. 2023, "DeepSpeed Ulysses", sec. 3).

Every layer except attention runs on a sequence shard ``[B, S/P, H, D]``. Before attention one
all-to-all per Q, K and V turns the shards into full-sequence, head-sharded tensors
``[B, S, H/P, D]``; any exact local attention runs on those heads; one all-to-all returns the
output to the sequence layout. Per layer and direction a rank moves 4 (S/P) b h elements
(the paper's 4Nh/P), so the volume stays constant when S and P grow together.

Grouped-query attention (``kv`` key/value heads for ``H`` query heads) needs ``H % P == 0``
and either ``kv % P == 0`` (each rank gets kv/P KV heads) or ``P % kv == 0`` (each KV head is
replicated P/kv times before the all-to-all, so each rank receives the one KV head its
query heads use; the backward of the replication sums the replicas' gradients).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.distributed import comm
from slipstream.sequence._autograd import all_to_all_dims

__all__ = ["DistributedAttention", "sdpa_attention", "ulysses_attention"]

LocalAttention = Callable[..., torch.Tensor]


def sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    dropout_p: float = 0.0,
    scale: float | None = None,
) -> torch.Tensor:
    """PyTorch SDPA on ``[B, S, H, D]`` tensors; K/V may have fewer heads (GQA, consecutive
    query heads share a KV head). Returns ``[B, S, H, D]``."""
    n_rep = q.shape[2] // k.shape[2]
    if n_rep > 1:
        k = k.repeat_interleave(n_rep, dim=2)
        v = v.repeat_interleave(n_rep, dim=2)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        dropout_p=dropout_p,
        is_causal=causal,
        scale=scale,
    )
    return out.transpose(1, 2)


def check_heads(num_heads: int, num_kv_heads: int, sp_world_size: int) -> None:
    """Raise ``ValueError`` naming the head counts when Ulysses cannot split them over P ranks."""
    p = sp_world_size
    if num_heads % p:
        raise ValueError(
            f"Ulysses needs the query heads to divide by the sequence-parallel size: "
            f"num_heads={num_heads} is not divisible by sp={p}. Use an sp size that divides "
            f"{num_heads}, or LSS attention (slipstream.sequence.lss_attention), which has no "
            "head constraint"
        )
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_kv_heads={num_kv_heads} does not divide num_heads={num_heads} (grouped-query "
            "attention needs a whole number of query heads per KV head)"
        )
    if num_kv_heads % p and p % num_kv_heads:
        raise ValueError(
            f"Ulysses with grouped-query attention needs num_kv_heads % sp == 0 or "
            f"sp % num_kv_heads == 0; got num_kv_heads={num_kv_heads}, sp={p}. Choose an sp "
            "size that divides or is a multiple of the KV head count"
        )


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"Ulysses expects 4-D q/k/v, got shapes {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    if k.shape != v.shape:
        raise ValueError(f"key shape {tuple(k.shape)} differs from value {tuple(v.shape)}")
    other = [d for d in range(4) if d != head_dim]
    if [q.shape[d] for d in other[:2]] != [k.shape[d] for d in other[:2]]:
        raise ValueError(
            f"query {tuple(q.shape)} and key {tuple(k.shape)} disagree outside the head and "
            "channel dims"
        )


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sp_group: comm.Group,
    *,
    causal: bool = True,
    attention: LocalAttention | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
) -> torch.Tensor:
    """Exact attention over a sequence sharded on ``sp_group`` (typed functional API).

    Args:
        q: this rank's queries ``[B, S/P, H, D]`` (rank r holds tokens r*S/P .. (r+1)*S/P-1).
        k, v: keys and values ``[B, S/P, kv, D]`` (``kv`` divides ``H``; see module docs).
        sp_group: the sequence-parallel process group (``mesh.get_group("sp")``).
        causal: apply a causal mask (no offsets needed: each rank sees the whole sequence).
        attention: local kernel on ``[B, S, H/P, D]`` tensors taking ``causal``,
            ``dropout_p`` and ``scale`` keywords; default :func:`sdpa_attention`.
        dropout_p, scale: passed to the local kernel.

    Returns:
        ``[B, S/P, H, D]``: this rank's rows of the full attention output.
    Raises:
        ValueError: shapes that cannot be split over the group (names the shapes).
    Communication: 3 all-to-alls in (Q, K, V; K/V shrink by kv/H when kv >= P) and 1 out
    forward, the same backward.
    """
    _check_inputs(q, k, v, head_dim=2)
    p = comm.get_world_size(sp_group)
    check_heads(q.shape[2], k.shape[2], p)
    kernel = attention or sdpa_attention
    if p == 1:
        return kernel(q, k, v, causal=causal, dropout_p=dropout_p, scale=scale)
    if k.shape[2] < p:  # GQA with fewer KV heads than ranks: one replica per rank
        rep = p // k.shape[2]
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    qh, kh, vh = (all_to_all_dims(t, sp_group, scatter_dim=2, gather_dim=1) for t in (q, k, v))
    out = kernel(qh, kh, vh, causal=causal, dropout_p=dropout_p, scale=scale)
    return all_to_all_dims(out, sp_group, scatter_dim=1, gather_dim=2)


class DistributedAttention(nn.Module):
    """DeepSpeed-compatible Ulysses wrapper: ``DistributedAttention(local_attention, group)``.

    ``forward(query, key, value, *args, **kwargs)`` takes sequence-sharded tensors, runs
    ``local_attention(q, k, v, *args, **kwargs)`` on the full sequence and ``1/P`` of the
    heads, and returns the output in the input layout.

    Args:
        local_attention: any module or callable on head-sharded tensors (it must handle
            grouped-query K/V with fewer heads itself, e.g. :func:`sdpa_attention`).
        sp_group: the sequence-parallel group; None until :meth:`set_sequence_parallel_group`
            binds it (``slipstream.initialize`` does, from the mesh's ``sp`` axis).
        scatter_idx: the head dim of the inputs (scattered going in), 2 for ``[B, S, H, D]``.
        gather_idx: the sequence dim of the inputs (gathered going in), 1 for ``[B, S, H, D]``
            (DeepSpeed's default layout ``[S, B, H, D]`` is ``gather_idx=0``).
    """

    def __init__(
        self,
        local_attention: LocalAttention,
        sp_group: comm.Group = None,
        scatter_idx: int = 2,
        gather_idx: int = 1,
    ) -> None:
        super().__init__()
        if scatter_idx == gather_idx:
            raise ValueError(f"scatter_idx and gather_idx must differ, both are {scatter_idx}")
        self.local_attn = local_attention
        self.sp_group = sp_group
        self.scatter_idx = scatter_idx
        self.gather_idx = gather_idx

    def set_sequence_parallel_group(self, sp_group: comm.Group) -> None:
        """Bind the group the sequence is sharded over."""
        self.sp_group = sp_group

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        _check_inputs(query, key, value, head_dim=self.scatter_idx)
        p = comm.get_world_size(self.sp_group)
        heads, kv = query.shape[self.scatter_idx], key.shape[self.scatter_idx]
        check_heads(heads, kv, p)
        if p == 1:
            return self.local_attn(query, key, value, *args, **kwargs)  # type: ignore[no-any-return]
        if kv < p:
            key = key.repeat_interleave(p // kv, dim=self.scatter_idx)
            value = value.repeat_interleave(p // kv, dim=self.scatter_idx)
        s, g = self.scatter_idx, self.gather_idx
        q, k, v = (all_to_all_dims(t, self.sp_group, s, g) for t in (query, key, value))
        out = self.local_attn(q, k, v, *args, **kwargs)
        return all_to_all_dims(out, self.sp_group, scatter_dim=g, gather_dim=s)
