"""LSS Transformer attention and its double gradient averaging (Wang et al. 2023,
"Ultra-Long Sequence Distributed Transformer", arXiv 2311.02382).

Each rank of the sequence-parallel group holds one segment of the sequence. Queries stay
local; keys and values are concatenated and all-gathered in *one* collective per layer, so
every rank computes the exact attention rows of its own queries against the whole sequence
(with a causal mask offset by its segment start). Autograd turns the gather into *one*
reduce-scatter (sum) of the K/V gradients. Nothing is aggregated after attention: the rows
are already complete. Per layer and direction a rank receives / sends
2 (P-1) (S/P) b kv D elements; memory holds the gathered K/V of the full sequence.

Gradient averaging. With the paper's loss (each rank: mean cross-entropy over its own
tokens), summing a parameter's gradient over the segments of one sequence gives P times the
gradient of the sequence's mean loss. Parameters replicated on every rank are therefore
averaged over the segment group (A) and then over the data-parallel group (B). Parameters
that are *segment-local* (a rank stores only its rows of a learned position embedding) have
nothing to average with in (A), but still carry the factor P: they must be divided by P and
then averaged in (B). Skipping that division is the "position-encoding trap": those
gradients come out P times too large. :func:`double_average_gradients_` does both levels.
Under ``slipstream.initialize`` none of this is needed: the sequence-parallel loss is the
global loss, and ZeRO averages every gradient over the combined dp x sp group.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from slipstream.distributed import comm
from slipstream.sequence._autograd import all_gather_segments

__all__ = ["double_average_gradients_", "lss_attention"]


def lss_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sp_group: comm.Group,
    *,
    causal: bool = True,
    dropout_p: float = 0.0,
    scale: float | None = None,
) -> torch.Tensor:
    """Exact attention rows of this rank's segment against the whole sequence.

    Args:
        q: queries of this rank's segment ``[B, S/P, H, D]`` (rank r holds tokens
            r*S/P .. (r+1)*S/P-1 of every sequence).
        k, v: keys and values of the segment ``[B, S/P, kv, D]``, ``kv`` dividing ``H``
            (grouped-query heads are expanded locally after the gather, so the wire carries
            only ``kv`` heads).
        sp_group: the sequence-parallel group.
        causal: mask keys after each query's global position.
        dropout_p: dropout on the attention probabilities.
        scale: softmax scale (default 1/sqrt(D)).

    Returns:
        ``[B, S/P, H, D]``.
    Raises:
        ValueError: mismatched shapes (named in the message).
    Communication: forward one all-gather of ``cat(k, v)``, backward one reduce-scatter of
    its gradient. Under a causal mask rank r only attends to the first (r+1) segments, so
    the keys after its segment are dropped before the score matrix.
    """
    if q.dim() != 4 or k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"lss_attention expects q [B, S/P, H, D] and k, v [B, S/P, kv, D]; got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    heads, kv_heads, seg = q.shape[2], k.shape[2], q.shape[1]
    if heads % kv_heads:
        raise ValueError(
            f"lss_attention: kv heads ({kv_heads}, from k {tuple(k.shape)}) must divide the "
            f"query heads ({heads}, from q {tuple(q.shape)})"
        )
    rank = comm.get_rank(sp_group)
    start = rank * seg
    kv = all_gather_segments(torch.cat((k, v), dim=-1), sp_group, dim=1)  # one collective
    if causal:
        kv = kv[:, : start + seg]
    k_all, v_all = kv.chunk(2, dim=-1)
    if heads != kv_heads:
        k_all = k_all.repeat_interleave(heads // kv_heads, dim=2)
        v_all = v_all.repeat_interleave(heads // kv_heads, dim=2)
    mask = None
    if causal:
        rows = torch.arange(start, start + seg, device=q.device)
        mask = torch.arange(k_all.shape[1], device=q.device)[None, :] <= rows[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k_all.transpose(1, 2),
        v_all.transpose(1, 2),
        attn_mask=mask,
        dropout_p=dropout_p,
        scale=scale,
    )
    return out.transpose(1, 2)


def double_average_gradients_(
    params: Iterable[torch.nn.Parameter],
    segment_group: comm.Group,
    data_group: comm.Group = None,
    segment_local: Iterable[torch.nn.Parameter] = (),
) -> None:
    """LSS's position-encoding-aware double gradient averaging, in place on ``.grad``.

    For a loss that is each rank's mean over its own tokens (the paper's convention):

    * (A) replicated parameters: all-reduce over ``segment_group`` and divide by P;
      ``segment_local`` parameters (each rank stores different rows, e.g. its slice of a
      learned position embedding) are only divided by P (there is no copy to average with,
      but the P-fold factor of the segment losses is still there);
    * (B) every parameter: all-reduce over ``data_group`` (the same segment of the other
      sequences) and divide by its size D; ``data_group=None`` means no data parallelism.

    The result equals the single-process gradient of the mean loss over the global batch.
    Communication: one all-reduce of the replicated gradients on the segment group and one
    of all gradients on the data group (each flattened into a single buffer).
    """
    local_ids = {id(p) for p in segment_local}
    shared = [p for p in params if p.grad is not None and id(p) not in local_ids]
    local = [p for p in segment_local if p.grad is not None]
    n_seg = comm.get_world_size(segment_group)
    _flat_all_reduce(shared, segment_group, "lss.avg_segments", 1.0 / n_seg)
    for p in local:
        assert p.grad is not None
        p.grad.div_(n_seg)
    if data_group is not None:
        n_data = comm.get_world_size(data_group)
        _flat_all_reduce(shared + local, data_group, "lss.avg_data", 1.0 / n_data)


def _flat_all_reduce(
    params: list[torch.nn.Parameter], group: comm.Group, label: str, factor: float
) -> None:
    if not params or comm.get_world_size(group) == 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.all_reduce(flat, group=group, label=label)
    flat.mul_(factor)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
