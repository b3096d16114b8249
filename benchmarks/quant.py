"""Quantized linear layers vs fp32/bf16 on this machine: time (median of runs) and bytes.

    .venv/bin/python benchmarks/quant.py [--shape 256 2048 2048] [--runs 7]

Times ``y = x W^T`` for x [M, K], W [N, K]: fp32 and bf16 ``F.linear``, and QuantLinear
W8A8 INT (``torch._int_mm`` and the 7-bit-weight FBGEMM path), W8A8 FP8 and W4A8 INT4/FP4,
each including activation quantization and the epilogue. Then an end-to-end forward of
slipstream's GPT ("small" preset) float vs quantized. Prints a table; medians of ``--runs``.
On a shared CPU the absolute numbers are noisy; compare ratios taken in one run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from slipstream.models import GPT, GPTConfig
from slipstream.quant import W4A8FP4, W8A8FP8, QuantLinear, W4A8Int4, W8A8Int, quantize_


def median_time(fn: Callable[[], object], runs: int) -> float:
    fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_linear(m: int, k: int, n: int, runs: int) -> None:
    torch.manual_seed(0)
    x, w = torch.randn(m, k), torch.randn(n, k) * 0.02
    rows: list[tuple[str, float, int]] = []
    rows.append(("fp32 F.linear", median_time(lambda: F.linear(x, w), runs), w.numel() * 4))
    xb, wb = x.bfloat16(), w.bfloat16()
    rows.append(("bf16 F.linear", median_time(lambda: F.linear(xb, wb), runs), w.numel() * 2))
    variants = [
        ("W8A8 INT torch._int_mm", "int8", "int8", "int_mm"),
        ("W7A8 INT fbgemm", "int8", "int8", "fbgemm"),
        ("W8A8 FP8 (e4m3)", "e4m3", "e4m3", "int_mm"),
        ("W4A8 INT4 (int_mm)", "int4", "int8", "int_mm"),
        ("W4A8 INT4 (fbgemm)", "int4", "int8", "fbgemm"),
        ("W4A8 FP4 (e2m1->e4m3)", "e2m1", "e4m3", "int_mm"),
    ]
    for label, wf, af, backend in variants:
        ql = QuantLinear.from_float(w, None, wf, af, backend=backend, group_size=64)  # type: ignore[arg-type]
        rows.append((label, median_time(lambda ql=ql: ql(x), runs), ql.weight_bytes()))
    base = rows[0][1]
    print(f"\nlinear M={m} K={k} N={n}, median of {runs} runs, {torch.get_num_threads()} threads")
    print(f"{'variant':28s} {'ms':>9s} {'vs fp32':>8s} {'weight bytes':>13s}")
    for label, t, nbytes in rows:
        print(f"{label:28s} {t * 1e3:9.2f} {base / t:7.2f}x {nbytes:13,d}")


def bench_model(runs: int, seq: int) -> None:
    cfg = GPTConfig.preset("small", max_seq_len=seq)
    ids = torch.randint(0, cfg.vocab_size, (4, seq))
    print(f"\nGPT 'small' forward, batch 4 x {seq} tokens, median of {runs} runs")
    base = None
    for label, qcfg in [
        ("fp32", None),
        ("W8A8 INT int_mm", W8A8Int()),
        ("W7A8 INT fbgemm", W8A8Int(backend="fbgemm")),
        ("W8A8 FP8", W8A8FP8()),
        ("W4A8 FP4", W4A8FP4()),
        ("W4A8 INT4 fbgemm", W4A8Int4(backend="fbgemm")),
    ]:
        torch.manual_seed(0)
        model = GPT(cfg).eval()
        if qcfg is not None:
            quantize_(model, qcfg)
        with torch.no_grad():
            t = median_time(lambda model=model: model(ids), runs)
        base = base or t
        print(f"{label:28s} {t * 1e3:9.1f} ms {base / t:7.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shape", type=int, nargs=3, default=[256, 2048, 2048], metavar=("M", "K", "N"))
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--skip-model", action="store_true")
    args = p.parse_args()
    bench_linear(*args.shape, runs=args.runs)
    if not args.skip_model:
        bench_model(max(3, args.runs // 2), args.seq)


if __name__ == "__main__":
    main()
