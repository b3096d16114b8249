"""Peak tensor memory of MMCA against standard attention at the same shapes (forward +
backward of one attention call, CPU, fp32).

Rows: SDPA with ``is_causal`` (the fused kernel, no mask), SDPA with an explicit boolean
causal+padding mask (ordinary masked attention), eager attention with a float additive mask
(HF's "eager" path), and ``mmca_attention`` in its three modes. The layout is a
conversation: text with ``--images`` images of ``--image-tokens`` tokens each.

    python benchmarks/mmca_memory.py --seq 2048
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from slipstream.multimodal import IMAGE, TEXT, mmca_attention
from slipstream.science._memory import TensorMemoryTracker

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _layout(b: int, length: int, images: int, image_tokens: int) -> torch.Tensor:
    types = torch.full((b, length), TEXT)
    gap = length // (images + 1)
    for i in range(images):
        start = gap * (i + 1) - image_tokens // 2
        types[:, start : start + image_tokens] = IMAGE
    return types


def _eager_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    n_rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1)
    length = q.shape[2]
    mask = torch.full((length, length), torch.finfo(q.dtype).min).triu(1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + mask
    return scores.softmax(-1) @ v


def peak_mib(fn: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> float:
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with TensorMemoryTracker() as mem:
        out = fn(*leaves)
        out.backward(torch.ones_like(out))
    return mem.peak_bytes / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--images", type=int, default=4)
    parser.add_argument("--image-tokens", type=int, default=64)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    b, h, kv, t, d = args.batch, args.heads, args.kv_heads, args.seq, args.head_dim
    q = torch.randn(b, h, t, d, generator=g)
    k, v = torch.randn(b, kv, t, d, generator=g), torch.randn(b, kv, t, d, generator=g)
    types = _layout(b, t, args.images, args.image_tokens)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    rows: dict[str, Attention] = {
        "SDPA is_causal (fused, no mask)": lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True
        ),
        "SDPA + boolean causal mask": lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, attn_mask=causal, enable_gqa=True
        ),
        "eager + float additive mask": _eager_masked,
        "MMCA paper": lambda q, k, v: mmca_attention(q, k, v, types, "paper"),
        "MMCA causal mode": lambda q, k, v: mmca_attention(q, k, v, types, "causal"),
        "MMCA reference_code": lambda q, k, v: mmca_attention(q, k, v, types, "reference_code"),
    }
    print(f"B={b} H={h} Hkv={kv} L={t} D={d}, {args.images} images x {args.image_tokens} tokens")
    print("| attention | peak tensor memory, fwd+bwd (MiB) |\n|---|---|")
    for name, fn in rows.items():
        print(f"| {name} | {peak_mib(fn, q, k, v):.1f} |")


if __name__ == "__main__":
    main()
