"""Rank bodies for ring and Ulysses x ring attention: fp64 outputs and gradients against
single-rank attention of the whole sequence, computed in the same process."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

BATCH, DIM = 2, 8

# (seq_len, ring size, ulysses size, query heads, kv heads, causal, packed documents)
Case = tuple[int, int, int, int, int, bool, bool]


def packed_positions(seq_len: int) -> torch.Tensor:
    """Position ids of rows packing several documents (restarting at 0), different per row."""
    rows = []
    for lengths in ([5, 9, seq_len - 14], [seq_len - 3, 3]):
        rows.append(torch.cat([torch.arange(n) for n in lengths]))
    return torch.stack(rows)


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, pos: torch.Tensor | None
) -> torch.Tensor:
    """Plain attention of the whole sequence, ``[B, S, H, D]``; packed rows attend within
    their document only."""
    s = q.shape[1]
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    allowed = torch.ones(s, s, dtype=torch.bool)
    if causal:
        allowed = allowed.tril()
    allowed = allowed.expand(q.shape[0], s, s)
    if pos is not None:
        start = torch.arange(s) - pos
        allowed = allowed & (start[:, :, None] == start[:, None, :])
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=allowed[:, None]
    )
    return out.transpose(1, 2)


def _case(mesh: Any, case: Case) -> dict[str, float]:
    from slipstream.distributed.mesh import sp_ring_groups
    from slipstream.sequence.ring import doc_starts, sequence_shard_indices, usp_attention

    seq, ring, uly, heads, kv, causal, packed = case
    ulysses_group, ring_group = sp_ring_groups(mesh, ring)
    g = torch.Generator().manual_seed(hash(case) % 2**31)
    q = torch.randn(BATCH, seq, heads, DIM, dtype=torch.float64, generator=g)
    k = torch.randn(BATCH, seq, kv, DIM, dtype=torch.float64, generator=g)
    v = torch.randn(BATCH, seq, kv, DIM, dtype=torch.float64, generator=g)
    grad = torch.randn(BATCH, seq, heads, DIM, dtype=torch.float64, generator=g)
    pos = packed_positions(seq) if packed else None
    idx = sequence_shard_indices(seq, ring, dist.get_rank(), uly)
    ql, kl, vl = (t[:, idx].clone().requires_grad_() for t in (q, k, v))
    doc = doc_starts(pos[:, idx], idx) if pos is not None else None
    out = usp_attention(ql, kl, vl, ulysses_group, ring_group, causal=causal, doc_start=doc)
    out.backward(grad[:, idx])
    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qf, kf, vf, causal, pos)
    ref.backward(grad)
    errors = {"out": (out.detach() - ref.detach()[:, idx]).abs().max().item()}
    for name, mine, full in (("dq", ql, qf), ("dk", kl, kf), ("dv", vl, vf)):
        assert mine.grad is not None and full.grad is not None
        errors[name] = (mine.grad - full.grad[:, idx]).abs().max().item()
    errors["scale"] = ref.abs().max().item()
    return errors


def kernel_world(cases: list[Case]) -> dict[Case, dict[str, float]]:
    from slipstream.distributed.mesh import ParallelDims, build_mesh

    world = dist.get_world_size()
    mesh = build_mesh(ParallelDims(world_size=world, sp=world), "cpu")
    return {case: _case(mesh, case) for case in cases}
