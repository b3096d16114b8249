"""The roofline of this CPU for one decode step of SmolLM2-135M's shape (fp32, one thread).

    .venv/bin/python benchmarks/roofline.py --batch 16 --context 96 \
        --measured hf=93 slipstream=156

A tiny probe measures what one core achieves: the fp32 GEMM rate (oneDNN's packed kernel on
a cache-resident ``[256, 2048] x [2048, 2048]`` product: the compute roof) and the memory
bandwidth (the sum of a 256 MiB tensor: the bandwidth roof). It then counts one decode
step's work at ``--batch`` rows and ``--context`` cached positions: FLOPs of the
projections, the LM head and attention; bytes of the weights (read once per step: the model
is far larger than the caches) and of the cached keys and values. The step can be no faster
than ``max(FLOPs / rate, bytes / bandwidth)``; ``--measured NAME=TOKENS_PER_S`` places
measured decoders (``benchmarks/generate.py``) against that bound. Last, every product of
a layer at ``--batch`` rows is timed with ``F.linear`` on the module's weight (what the
Hugging Face forward runs) and with the fused, oneDNN-packed weights of
``slipstream.inference.fused``.

CPU time (``time.process_time``) is the clock, as elsewhere on this shared machine; the
probe figures still drop under load (other processes share the caches and the memory bus).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

# SmolLM2-135M
HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, VOCAB = 576, 1536, 30, 9, 3, 49152
HEAD_DIM = HIDDEN // HEADS


def cpu_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median CPU seconds of ``fn`` over ``repeats`` calls (after two warm-up calls)."""
    fn()
    fn()
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return sorted(times)[len(times) // 2]


def packed(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    w = torch.ops.mkldnn._reorder_linear_weight(weight, 16)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


def probe() -> tuple[float, float]:
    """(GEMM FLOP/s, read bandwidth in bytes/s) of one core."""
    a, w = torch.randn(256, 2048), torch.randn(2048, 2048)
    gemm = packed(w)
    flops = 2 * 256 * 2048 * 2048 / cpu_seconds(lambda: gemm(a), 15)
    big = torch.randn(64 * 2**20)  # 256 MiB
    bandwidth = big.numel() * 4 / cpu_seconds(big.sum, 7)
    return flops, bandwidth


def step_work(batch: int, context: int) -> tuple[float, float]:
    """(FLOPs, bytes) of one fp32 decode step."""
    layer_params = (
        HIDDEN * (HIDDEN + 2 * KV_HEADS * HEAD_DIM) + HIDDEN * HIDDEN + 3 * HIDDEN * INTER
    )
    params = LAYERS * layer_params + VOCAB * HIDDEN  # the head (tied to the embeddings)
    attention = LAYERS * 4 * batch * context * HEADS * HEAD_DIM  # scores and weighted values
    kv_bytes = LAYERS * 2 * batch * context * KV_HEADS * HEAD_DIM * 4
    return 2 * params * batch + attention, params * 4 + kv_bytes


def products(batch: int) -> None:
    """Each product of a layer (and the head): F.linear against the fused, packed weights."""
    x, xi = torch.randn(batch, HIDDEN), torch.randn(batch, INTER)
    kv = KV_HEADS * HEAD_DIM
    shapes = {"q": (HIDDEN, x), "k": (kv, x), "v": (kv, x), "o": (HIDDEN, x),
              "gate": (INTER, x), "up": (INTER, x), "down": (HIDDEN, xi)}  # fmt: skip
    weights = {n: torch.randn(out, inp.shape[1]) for n, (out, inp) in shapes.items()}
    plain = sum(cpu_seconds(lambda n=n: F.linear(shapes[n][1], weights[n]), 30) for n in shapes)
    qkv = packed(torch.cat([weights["q"], weights["k"], weights["v"]]))
    gate_up = packed(torch.cat([weights["gate"], weights["up"]]))
    o, down = packed(weights["o"]), packed(weights["down"])
    fused = sum(cpu_seconds(fn, 30) for fn in (lambda: qkv(x), lambda: gate_up(x),
                                               lambda: o(x), lambda: down(xi)))  # fmt: skip
    head = torch.randn(VOCAB, HIDDEN)
    head_plain = cpu_seconds(lambda: F.linear(x, head), 7)
    head_packed = packed(head)
    head_fast = cpu_seconds(lambda: head_packed(x), 7)
    print(f"one layer's products at {batch} rows: F.linear x7 {plain * 1e3:.2f} ms, fused and "
          f"packed x4 {fused * 1e3:.2f} ms ({plain / fused:.2f}x); LM head {head_plain * 1e3:.1f}"
          f" ms vs {head_fast * 1e3:.1f} ms packed")  # fmt: skip
    print(
        f"GEMM time of a step: {(LAYERS * plain + head_plain) * 1e3:.0f} ms with F.linear, "
        f"{(LAYERS * fused + head_fast) * 1e3:.0f} ms fused and packed"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument(
        "--context",
        type=int,
        default=96,
        help="cached positions per row (prompt + half the new tokens)",
    )
    parser.add_argument("--measured", nargs="*", default=[], metavar="NAME=TOKENS_PER_S")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, load average {os.getloadavg()[0]:.1f} at start")
    flops_rate, bandwidth = probe()
    flops, nbytes = step_work(args.batch, args.context)
    t_compute, t_memory = flops / flops_rate, nbytes / bandwidth
    bound = max(t_compute, t_memory)
    print(f"probe: GEMM {flops_rate / 1e9:.0f} GFLOP/s, memory read {bandwidth / 1e9:.1f} GB/s "
          f"(ridge {flops_rate / bandwidth:.1f} FLOP/byte)")  # fmt: skip
    print(f"step at batch {args.batch}, {args.context} cached positions: "
          f"{flops / 1e9:.2f} GFLOP, {nbytes / 1e6:.0f} MB ({flops / nbytes:.1f} FLOP/byte): "
          f"compute {t_compute * 1e3:.1f} ms, memory {t_memory * 1e3:.1f} ms; roofline "
          f"{args.batch / bound:.0f} tokens/s ({'compute' if t_compute > t_memory else 'memory'}"
          "-bound)")  # fmt: skip
    for item in args.measured:
        name, value = item.split("=")
        tps = float(value)
        print(f"  {name}: {tps:.0f} tokens/s = {tps * bound / args.batch:.0%} of the roofline "
              f"({args.batch / tps * 1e3:.0f} ms a step)")  # fmt: skip
    products(args.batch)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
