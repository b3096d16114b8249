"""Ring attention (context parallelism) with a zig-zag load-balanced split, and its 2-D
combination with Ulysses (USP: Fang and Zhao 2024, "USP: A Unified Sequence Parallelism
Approach"; ring attention: Liu et al. 2023; zig-zag balance as in Megatron-LM's context
parallelism and ``ring-flash-attention``).

Layout. A sequence of ``S`` tokens is cut into ``2R`` equal chunks for ``R`` ring ranks; ring
rank ``i`` holds chunks ``i`` and ``2R-1-i`` (so under a causal mask every rank has the same
amount of work: an early chunk that attends to little and a late one that attends to much).
With Ulysses of degree ``U`` on top (``P = R * U`` ranks, sp rank ``i * U + j``), ring piece
``i`` is split again into ``U`` contiguous parts and sp rank ``i*U + j`` holds part ``j``.
:func:`sequence_shard_indices` gives the global token indices a rank holds;
:func:`shard_sequence_zigzag` cuts a batch accordingly.

Forward. Each rank keeps its queries; the keys and values travel around the ring (``R-1``
hops; the next hop's send/receive is posted before the current block is computed, so the
transfer overlaps the computation). Each (query chunk, key chunk) block is exact attention
that also returns its log-sum-exp; blocks are merged with the online-softmax rule
``lse = logaddexp(lse_a, lse_b)``, ``o = o_a exp(lse_a - lse) + o_b exp(lse_b - lse)``. Blocks
whose key chunk lies after the query chunk are skipped (causal), the diagonal block is masked
causally. Only ``O(S/P)`` activations are kept: q, k, v, the output and the log-sum-exp.

Backward. A second ring pass: the keys and values travel again (overlapped as in the forward)
and each block's gradient contribution to them travels with them, accumulated hop by hop,
so after ``R`` hops every rank holds the full gradient of its own keys and values. Scores are
recomputed from q, k and the saved log-sum-exp (as FlashAttention's backward does).

Heads. Ring attention has no head constraint (any query head count, grouped-query K/V with
any KV head count); Ulysses inside it needs the query heads divisible by ``U`` and the KV
heads divisible by ``U`` or dividing it (they are then replicated, as in
:mod:`slipstream.sequence.ulysses`). USP is the layout for ``P`` larger than the KV heads.

Packed documents. ``doc_start`` (the global index of the first token of each token's
document; :func:`doc_starts` computes it from position ids that restart at 0 per document)
restricts attention to tokens of the same document, so several documents packed into one
row never attend to each other.

Communication per layer on each rank (ring of ``R``): forward ``R-1`` sends of its K/V
shard; backward ``R-1`` sends of K/V and ``R`` sends of their gradient (fp32 for bf16
inputs). Through :mod:`slipstream.distributed.comm` (counted as ``sp.ring_kv`` /
``sp.ring_dkv``).
"""

from __future__ import annotations

from typing import Any

import torch

from slipstream.distributed import comm
from slipstream.sequence._autograd import all_to_all_dims
from slipstream.sequence._ring_blocks import (
    _acc_dtype,
    _block_forward,
    _block_mask,
    _fused,
    _fused_backward,
    _fused_forward,
    _merge,
    _scores,
    _tiles,
    tile_mask,
)
from slipstream.sequence.zigzag import (
    check_length,
    doc_starts,
    sequence_shard_indices,
    shard_batch_zigzag,
    shard_sequence_zigzag,
    unshard_sequence_zigzag,
)

__all__ = [
    "check_length",
    "doc_starts",
    "ring_attention",
    "ring_attention_heads_first",
    "sequence_shard_indices",
    "shard_batch_zigzag",
    "shard_sequence_zigzag",
    "unshard_sequence_zigzag",
    "usp_attention",
]


class _Ring:
    """The ring's neighbours (global ranks) and chunk bookkeeping for one call."""

    def __init__(self, group: comm.Group, local_len: int) -> None:
        self.group = group
        self.size = comm.get_world_size(group)
        self.rank = comm.get_rank(group)
        self.next = comm.global_rank(group, (self.rank + 1) % self.size)
        self.prev = comm.global_rank(group, (self.rank - 1) % self.size)
        if local_len % 2:
            raise ValueError(
                f"ring attention: the local sequence has {local_len} tokens; the zig-zag "
                "layout needs two equal chunks per rank (an even local length)"
            )
        self.chunk = local_len // 2

    def chunks(self, ring_rank: int) -> tuple[int, int]:
        return ring_rank, 2 * self.size - 1 - ring_rank

    def source(self, step: int) -> int:
        """The ring rank whose K/V this rank holds at ``step``."""
        return (self.rank - step) % self.size

    def exchange(self, send: torch.Tensor, label: str) -> tuple[torch.Tensor, list[Any]]:
        """Post the send of ``send`` to the next rank and the receive of the previous one's."""
        recv = torch.empty_like(send)
        works = [
            comm.isend(send, self.next, self.group, label=label),
            comm.irecv(recv, self.prev, self.group, label=label),
        ]
        return recv, works


def _wait(works: list[Any]) -> None:
    for work in works:
        work.wait()


def _pieces(t: torch.Tensor | None, chunk: int, dim: int) -> list[torch.Tensor | None]:
    if t is None:
        return [None, None]
    return list(t.split(chunk, dim=dim))


def _ring_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc: torch.Tensor | None,
    ring: _Ring,
    scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[B, kv, g, 2c, D]``, k/v ``[B, kv, 1, 2c, D]`` (accumulation dtype), doc
    ``[B, 2c]`` or None: the output and log-sum-exp of this rank's queries."""
    c = ring.chunk
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
    kv = torch.stack([k, v])
    q_doc = _pieces(doc, c, 1)
    kv_doc = doc
    my_chunks = ring.chunks(ring.rank)
    for step in range(ring.size):
        works: list[Any] = []
        if step < ring.size - 1:  # the next hop overlaps this step's blocks
            nxt, works = ring.exchange(kv, "sp.ring_kv")
            if doc is not None:
                assert kv_doc is not None
                nxt_doc, doc_works = ring.exchange(kv_doc, "sp.ring_doc")
                works += doc_works
        k_pieces = kv[0].split(c, dim=3)
        v_pieces = kv[1].split(c, dim=3)
        k_doc = _pieces(kv_doc, c, 1)
        for a, qc in enumerate(my_chunks):
            for b, kc in enumerate(ring.chunks(ring.source(step))):
                skip, mask, diagonal = _block_mask(qc, kc, causal, q_doc[a], k_doc[b])
                if skip:
                    continue
                if _fused(q):
                    rows = slice(a * c, (a + 1) * c)
                    blk_out, blk_lse = _fused_forward(
                        q[..., rows, :], k_pieces[b], v_pieces[b], scale, mask, diagonal
                    )
                    out[..., rows, :], lse[..., rows] = _merge(
                        out[..., rows, :], lse[..., rows], blk_out, blk_lse
                    )
                    continue
                for lo, hi in _tiles(c):  # bounded score memory: ROW_TILE x c per head
                    rows = slice(a * c + lo, a * c + hi)
                    tile = tile_mask(mask, diagonal, lo, hi, c, q.device)
                    blk_out, blk_lse = _block_forward(
                        q[..., rows, :], k_pieces[b], v_pieces[b], scale, tile
                    )
                    out[..., rows, :], lse[..., rows] = _merge(
                        out[..., rows, :], lse[..., rows], blk_out, blk_lse
                    )
        _wait(works)
        if step < ring.size - 1:
            kv = nxt
            if doc is not None:
                kv_doc = nxt_doc
    return out, lse


def _ring_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    doc: torch.Tensor | None,
    ring: _Ring,
    scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The second ring pass: dq of this rank's queries, dk/dv of this rank's keys/values."""
    c = ring.chunk
    delta = (grad_out * out).sum(-1)  # [B, kv, g, 2c]
    safe_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    dq = torch.zeros_like(q)
    kv = torch.stack([k, v])
    q_doc = _pieces(doc, c, 1)
    kv_doc = doc
    my_chunks = ring.chunks(ring.rank)
    acc: torch.Tensor | None = None  # the travelling gradient of the K/V held this step
    pending: list[Any] = []
    sent: list[torch.Tensor] = []  # kept alive until their sends complete
    for step in range(ring.size):
        works: list[Any] = []
        acc_works: list[Any] = []
        incoming: torch.Tensor | None = None
        if step > 0:  # posted first: the previous rank sent it before its next K/V hop
            incoming = torch.empty_like(kv)
            acc_works = [comm.irecv(incoming, ring.prev, ring.group, label="sp.ring_dkv")]
        if step < ring.size - 1:
            nxt, works = ring.exchange(kv, "sp.ring_kv")
            if doc is not None:
                assert kv_doc is not None
                nxt_doc, doc_works = ring.exchange(kv_doc, "sp.ring_doc")
                works += doc_works
        local = torch.zeros_like(kv)  # [2, B, kv, 1, 2c, D]
        k_doc = _pieces(kv_doc, c, 1)
        for a, qc in enumerate(my_chunks):
            for b, kc in enumerate(ring.chunks(ring.source(step))):
                skip, mask, diagonal = _block_mask(qc, kc, causal, q_doc[a], k_doc[b])
                if skip:
                    continue
                cols = slice(b * c, (b + 1) * c)
                kb, vb = kv[0][..., cols, :], kv[1][..., cols, :]
                if _fused(q):
                    rows = slice(a * c, (a + 1) * c)
                    dq_b, dk_b, dv_b = _fused_backward(
                        grad_out[..., rows, :],
                        q[..., rows, :],
                        kb,
                        vb,
                        out[..., rows, :],
                        safe_lse[..., rows],
                        scale,
                        mask,
                        diagonal,
                    )
                    dq[..., rows, :] += dq_b
                    local[0][..., cols, :] += dk_b
                    local[1][..., cols, :] += dv_b
                    continue
                for lo, hi in _tiles(c):
                    rows = slice(a * c + lo, a * c + hi)
                    tile = tile_mask(mask, diagonal, lo, hi, c, q.device)
                    s = _scores(q[..., rows, :], kb, scale, tile)
                    p = torch.exp(s - safe_lse[..., rows, None])
                    do = grad_out[..., rows, :]
                    local[1][..., cols, :] += torch.matmul(p.transpose(-1, -2), do).sum(
                        2, keepdim=True
                    )
                    ds = p * (torch.matmul(do, vb.transpose(-1, -2)) - delta[..., rows, None])
                    dq[..., rows, :] += torch.matmul(ds, kb) * scale
                    local[0][..., cols, :] += (
                        torch.matmul(ds.transpose(-1, -2), q[..., rows, :]).sum(2, keepdim=True)
                        * scale
                    )
        _wait(acc_works)
        acc = local if incoming is None else incoming + local
        if ring.size > 1:  # waited at the end: the next rank receives it a step later
            pending.append(comm.isend(acc, ring.next, ring.group, label="sp.ring_dkv"))
            sent.append(acc)
        _wait(works)
        if step < ring.size - 1:
            kv = nxt
            if doc is not None:
                kv_doc = nxt_doc
    # After R hops the gradient of this rank's own K/V arrives from the previous rank.
    assert acc is not None
    if ring.size > 1:
        final = torch.empty_like(acc)
        comm.irecv(final, ring.prev, ring.group, label="sp.ring_dkv").wait()
        _wait(pending)
        acc = final
    return dq, acc[0], acc[1]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        doc: torch.Tensor | None,
        group: comm.Group,
        scale: float,
        causal: bool,
    ) -> torch.Tensor:
        # [B, H, S, D] / [B, kv, S, D] -> grouped [B, kv, g, S, D] in the accumulation dtype.
        acc = _acc_dtype(q.dtype)
        b, h, s, d = q.shape
        kvh = k.shape[1]
        qg = q.to(acc).view(b, kvh, h // kvh, s, d)
        kg, vg = (t.to(acc).unsqueeze(2) for t in (k, v))
        ring = _Ring(group, s)
        out, lse = _ring_forward(qg, kg, vg, doc, ring, scale, causal)
        ctx.save_for_backward(qg, kg, vg, out, lse, doc)
        ctx.group, ctx.scale, ctx.causal, ctx.dtypes = group, scale, causal, (q.dtype, k.dtype)
        return out.view(b, h, s, d).to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        qg, kg, vg, out, lse, doc = ctx.saved_tensors
        ring = _Ring(ctx.group, qg.shape[3])
        go = grad.to(qg.dtype).reshape(qg.shape)
        dq, dk, dv = _ring_backward(go, qg, kg, vg, out, lse, doc, ring, ctx.scale, ctx.causal)
        q_dtype, k_dtype = ctx.dtypes
        b, kvh, g, s, d = qg.shape
        return (
            dq.view(b, kvh * g, s, d).to(q_dtype),
            dk.squeeze(2).to(k_dtype),
            dv.squeeze(2).to(k_dtype),
            None,
            None,
            None,
            None,
        )


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(
            f"ring attention expects 4-D q and equal 4-D k/v, got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(
            f"ring attention: {k.shape[1]} key/value heads do not divide {q.shape[1]} query "
            "heads (grouped-query attention needs a whole number of query heads per KV head)"
        )


def ring_attention_heads_first(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ring_group: comm.Group,
    *,
    causal: bool = True,
    scale: float | None = None,
    doc_start: torch.Tensor | None = None,
) -> torch.Tensor:
    """Ring attention on ``[B, H, S/R, D]`` queries and ``[B, kv, S/R, D]`` keys/values in the
    zig-zag layout (Hugging Face's layout); returns ``[B, H, S/R, D]``. See
    :func:`ring_attention`."""
    _check_qkv(q, k, v)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _RingAttention.apply(q, k, v, doc_start, ring_group, scale, causal)  # type: ignore[no-any-return]


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ring_group: comm.Group,
    *,
    causal: bool = True,
    scale: float | None = None,
    doc_start: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact attention over a sequence split zig-zag over ``ring_group`` (typed API).

    Args:
        q: this rank's queries ``[B, S/R, H, D]`` (chunks ``r`` and ``2R-1-r`` of ``2R``).
        k, v: keys and values ``[B, S/R, kv, D]``; ``kv`` divides ``H``, any count.
        ring_group: the ring (``mesh.get_group("sp")`` for pure ring attention).
        causal: causal mask on global positions.
        scale: softmax scale, default ``D ** -0.5``.
        doc_start: ``[B, S/R]`` document ids of packed rows (:func:`doc_starts`), or None.

    Returns:
        ``[B, S/R, H, D]``, this rank's rows of the full attention output.
    Raises:
        ValueError: shapes that do not fit (names them).
    """
    out = ring_attention_heads_first(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        ring_group,
        causal=causal,
        scale=scale,
        doc_start=doc_start,
    )
    return out.transpose(1, 2)


def check_usp_heads(heads: int, kv: int, ulysses_size: int) -> str | None:
    """The error message when Ulysses of degree ``ulysses_size`` cannot split the heads."""
    u = ulysses_size
    if heads % u or (kv % u and u % kv):
        return (
            f"Ulysses x ring: the Ulysses degree {u} must divide num_attention_heads={heads} and "
            f"divide or be a multiple of num_key_value_heads={kv}; choose a larger "
            "sequence_parallel_ring_size (pure ring, ring size = sequence_parallel_size, has "
            "no head constraint)"
        )
    return None


def usp_attention_heads_first(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ulysses_group: comm.Group,
    ring_group: comm.Group,
    *,
    causal: bool = True,
    scale: float | None = None,
    doc_start: torch.Tensor | None = None,
) -> torch.Tensor:
    """Ulysses x ring on ``[B, H, S/P, D]`` tensors (see the module docs for the layout):
    all-to-all over ``ulysses_group`` (heads scattered, the ring piece gathered), ring
    attention over ``ring_group`` on ``H/U`` heads, all-to-all back. ``doc_start`` is this
    rank's ``[B, S/P]`` part (gathered over Ulysses here)."""
    u = comm.get_world_size(ulysses_group)
    if u == 1:
        return ring_attention_heads_first(
            q, k, v, ring_group, causal=causal, scale=scale, doc_start=doc_start
        )
    _check_qkv(q, k, v)
    message = check_usp_heads(q.shape[1], k.shape[1], u)
    if message is not None:
        raise ValueError(message)
    if k.shape[1] < u:  # one KV head per Ulysses rank: replicate (summed back in backward)
        k = k.repeat_interleave(u // k.shape[1], dim=1)
        v = v.repeat_interleave(u // v.shape[1], dim=1)
    qh, kh, vh = (all_to_all_dims(t, ulysses_group, scatter_dim=1, gather_dim=2) for t in (q, k, v))
    if doc_start is not None:
        mine = doc_start.t().contiguous()  # [S/P, B]: rank-major gather is sequence-major
        parts = torch.empty(
            (u * mine.shape[0], mine.shape[1]), dtype=mine.dtype, device=mine.device
        )
        comm.all_gather_into_tensor(parts, mine, group=ulysses_group, label="sp.usp_doc")
        doc_start = parts.t()
    out = ring_attention_heads_first(
        qh, kh, vh, ring_group, causal=causal, scale=scale, doc_start=doc_start
    )
    return all_to_all_dims(out, ulysses_group, scatter_dim=2, gather_dim=1)


def usp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ulysses_group: comm.Group,
    ring_group: comm.Group,
    *,
    causal: bool = True,
    scale: float | None = None,
    doc_start: torch.Tensor | None = None,
) -> torch.Tensor:
    """Ulysses x ring attention on ``[B, S/P, H, D]`` tensors (the typed API; see
    :func:`usp_attention_heads_first`)."""
    out = usp_attention_heads_first(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        ulysses_group,
        ring_group,
        causal=causal,
        scale=scale,
        doc_start=doc_start,
    )
    return out.transpose(1, 2)
