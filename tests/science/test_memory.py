"""Peak tensor memory: the tiled kernel stays far below the naive formula, and the tracker is exact."""

from __future__ import annotations

import torch

from slipstream.science import evoformer_attention, evoformer_attention_reference
from slipstream.science._memory import TensorMemoryTracker


def _peak_fwd_bwd(fn, length: int, **tiles: int) -> int:
    """Peak bytes allocated by forward + backward (grads of Q, K, V and the pair bias)."""
    b, n, h, d = 1, 8, 4, 16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, n, length, h, d, generator=g).requires_grad_() for _ in range(3))
    mask = torch.zeros(b, n, 1, 1, length)
    pair = torch.randn(b, 1, h, length, length, generator=g).requires_grad_()
    grad = torch.randn(b, n, length, h, d, generator=g)
    with TensorMemoryTracker() as mem:
        out = fn(q, k, v, [mask, pair], **tiles)
        torch.autograd.grad(out, (q, k, v, pair), grad)
    return mem.peak_bytes


def test_tracker_counts_live_tensors_and_frees() -> None:
    """The tracker sees allocations, frees and autograd's backward buffers; inputs are free."""
    x = torch.randn(256, 256, requires_grad=True)  # 256 KiB, created outside: not counted
    with TensorMemoryTracker() as mem:
        y = torch.empty(1024)  # 4 KiB
        del y
        z = (x @ x).sum()  # the 256 KiB matmul output lives until sum is done
        z.backward()  # x.grad: 256 KiB, plus transient backward buffers
        x.data.mul_(2)  # in place on an input: nothing new
    assert mem.live_bytes == 256 * 1024 + 4  # x.grad and the scalar z
    assert 2 * 256 * 1024 <= mem.peak_bytes < 4 * 256 * 1024


def test_tiled_peak_is_far_below_naive_and_grows_linearly_in_length() -> None:
    """At L=256 the tiled fwd+bwd peak is < 1/4 of naive; from L=128 to 256 naive grows ~4x, tiled ~2x."""
    tiles = {"q_tile": 32, "kv_tile": 32, "n_tile": 2}
    naive = {n: _peak_fwd_bwd(evoformer_attention_reference, n) for n in (128, 256)}
    tiled = {n: _peak_fwd_bwd(evoformer_attention, n, **tiles) for n in (128, 256)}
    # Naive holds several [B, N, H, L, L] fp32 tensors (8 MiB each at L=256).
    logits_bytes = 8 * 4 * 256 * 256 * 4
    assert naive[256] >= 2 * logits_bytes
    assert tiled[256] * 4 < naive[256], (tiled, naive)
    assert naive[256] / naive[128] > 3.5
    # Tiled: O, dQ, dK, dV grow with L, the pair-bias gradient with L^2 (but not with N).
    assert tiled[256] / tiled[128] < 2.6, (tiled, naive)
