"""Single-GPU training: throughput, MFU and peak memory of slipstream vs plain PyTorch, and
ZeRO-Offload vs DeepSpeed's, on whatever card is visible. One run prints every row.

Compute rows (``--models gpt-1b llama-1b``), bf16, sequence 2048, each block compiled with
``torch.compile`` (the regional recipe torchtitan uses), SDPA attention (flash on Hopper),
fused AdamW, gradient clipping 1.0 everywhere:

* ``torch-amp``: fp32 weights under ``torch.autocast(bfloat16)`` (PyTorch's AMP recipe);
* ``torch-bf16``: bf16 weights and bf16 AdamW states, no master copy (the least work any
  trainer can do per step; less precise, shown as the speed ceiling);
* ``slipstream``: ``slipstream.initialize`` with ``bf16`` and ZeRO-1 (bf16 weights, fp32 master
  weights and AdamW states), ``engine.compile()``.

Offload rows (``--offload-model gpt-3b``): ZeRO-2 with ``offload_optimizer: cpu`` and
``pin_memory`` (fp32 master weights and AdamW states in host memory, the update on the CPU):
slipstream vs DeepSpeed (its ``DeepSpeedCPUAdam``, JIT-compiled on first use), same config,
no compile for either.

MFU = tokens/s x FLOPs per token / the card's dense bf16 peak (datasheet: 989 TFLOP/s for
H100 SXM and H200); FLOPs per token = 6 x (parameters without the embedding) + 12 x layers x
heads x head_dim x sequence (torchtitan's convention: attention counted without the causal
halving). The measured peak of one large bf16 matmul is printed beside it.

    python -m benchmarks.gpu_train                 # every section, on the visible GPU
    python -m benchmarks.gpu_train --dry-run       # tiny models on the CPU: the code paths only

Each model and each offload row runs in its own process (a crash or OOM costs one row);
``--out DIR`` keeps each row's JSON record.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class ModelShape:
    """A LLaMA-style decoder: the reference GPT or HF ``LlamaForCausalLM`` of this shape."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    seq: int
    micro_batch: int


_MODELS = {
    # LLaMA-3.2-1B's body with LLaMA-2's vocabulary: 1.1B parameters. Micro batch 8: on an
    # H200 it gave every row 3-4 MFU points more than 4 (docs/gpu.md).
    "1b": ModelShape(32000, 2048, 16, 32, 8, 8192, 2048, 8),
    # 3.0B parameters: the offload rows.
    "3b": ModelShape(32000, 3072, 28, 24, 8, 8192, 2048, 4),
    # The dry run on a CPU.
    "tiny": ModelShape(256, 64, 2, 4, 2, 128, 64, 2),
}


@dataclass
class Row:
    """One measured configuration."""

    name: str
    model: str
    params: int
    tokens_per_step: int
    step_s: float = math.nan
    tokens_per_s: float = math.nan
    mfu: float = math.nan
    tflops: float = math.nan
    peak_gib: float = math.nan
    host_peak_gib: float = math.nan
    loss: float = math.nan
    error: str = ""


# ------------------------------------------------------------------------------ models
def build_model(kind: str, shape: ModelShape, device: torch.device) -> nn.Module:
    """``gpt``: slipstream's reference GPT; ``llama``: transformers' LlamaForCausalLM."""
    torch.manual_seed(0)
    if kind == "gpt":
        from slipstream.models import GPT, GPTConfig

        cfg = GPTConfig(
            vocab_size=shape.vocab,
            hidden_size=shape.hidden,
            num_layers=shape.layers,
            num_heads=shape.heads,
            num_kv_heads=shape.kv_heads,
            intermediate_size=shape.intermediate,
            max_seq_len=shape.seq,
        )
        with device:
            return GPT(cfg)
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.seq,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    with device:
        return LlamaForCausalLM(hf)


def loss_of(kind: str, model: Callable[..., Any], x: torch.Tensor) -> torch.Tensor:
    """Next-token loss of a batch: the GPT shifts by hand, HF shifts its labels itself."""
    if kind == "gpt":
        return model(x[:, :-1], x[:, 1:])
    # No KV cache in training (HF builds one by default, and its per-layer state makes
    # torch.compile recompile each block).
    return model(input_ids=x[:, :-1], labels=x[:, :-1], use_cache=False).loss


def flops_per_token(model: nn.Module, shape: ModelShape) -> float:
    """torchtitan's count: 6 N (N without the input embedding) + 12 L H Q T."""
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embed is None:
        embed = model.embed_tokens  # type: ignore[assignment]
    n = sum(p.numel() for p in model.parameters()) - embed.weight.numel()
    head_dim = shape.hidden // shape.heads
    return 6 * n + 12 * shape.layers * shape.heads * head_dim * shape.seq


def blocks_of(model: nn.Module) -> list[nn.Module]:
    from slipstream.runtime.compile import repeated_blocks

    return repeated_blocks(model)


# ------------------------------------------------------------------------------ timing
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _host_peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def timed_steps(
    step: Callable[[], torch.Tensor], device: torch.device, warmup: int, steps: int
) -> tuple[float, float]:
    """Median seconds per step over three windows of ``steps`` steps, and the last loss."""
    for _ in range(warmup):
        loss = step()
    _sync(device)
    windows = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(steps):
            loss = step()
        _sync(device)
        windows.append((time.perf_counter() - t0) / steps)
    return statistics.median(windows), float(loss.detach().float())


@contextmanager
def measured(row: Row, device: torch.device) -> Iterator[None]:
    """Fill ``row``'s error on failure, its peak device memory on success; free everything."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    try:
        yield
        if device.type == "cuda":
            row.peak_gib = torch.cuda.max_memory_allocated() / 2**30
        row.host_peak_gib = _host_peak_gib()
    except Exception as err:  # a row's failure is reported, the run goes on
        row.error = f"{type(err).__name__}: {err}"[:400]
        traceback.print_exc()
    finally:
        gc.collect()
        torch._dynamo.reset()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _finish(row: Row, seconds: float, loss: float, fpt: float, peak_tflops: float) -> None:
    row.step_s, row.loss = seconds, loss
    row.tokens_per_s = row.tokens_per_step / seconds
    row.tflops = row.tokens_per_s * fpt / 1e12
    row.mfu = 100 * row.tflops / peak_tflops if peak_tflops else math.nan


# ------------------------------------------------------------------------- the rows
@dataclass
class RunArgs:
    kind: str
    shape: ModelShape
    device: torch.device
    warmup: int
    steps: int
    backend: str
    peak_tflops: float


def _batch(a: RunArgs) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, a.shape.vocab, (a.shape.micro_batch, a.shape.seq + 1), generator=g)
    return x.to(a.device)


def run_torch(a: RunArgs, name: str) -> Row:
    """Plain PyTorch: ``torch-amp`` (fp32 weights, autocast) or ``torch-bf16``."""
    row = Row(name, a.kind, 0, a.shape.micro_batch * a.shape.seq)
    with measured(row, a.device):
        model = build_model(a.kind, a.shape, a.device)
        if name == "torch-bf16":
            model = model.to(torch.bfloat16)
        row.params = sum(p.numel() for p in model.parameters())
        fpt = flops_per_token(model, a.shape)
        fused = {"fused": True}
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, **fused)
        for block in blocks_of(model):
            block.compile(backend=a.backend)
        x = _batch(a)
        amp = name == "torch-amp"

        def step() -> torch.Tensor:
            with torch.autocast(a.device.type, dtype=torch.bfloat16, enabled=amp):
                loss = loss_of(a.kind, model, x)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        seconds, loss = timed_steps(step, a.device, a.warmup, a.steps)
        _finish(row, seconds, loss, fpt, a.peak_tflops)
    return row


def slipstream_config(a: RunArgs, stage: int, offload: bool) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        zero.update(overlap_comm=True, contiguous_gradients=True)
    return {
        "train_micro_batch_size_per_gpu": a.shape.micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
    }


def run_engine(a: RunArgs, name: str, offload: bool, compile_: bool) -> Row:
    """slipstream or DeepSpeed (``name`` starts with "deepspeed") through their initialize."""
    row = Row(name, a.kind, 0, a.shape.micro_batch * a.shape.seq)
    with measured(row, a.device):
        if name.startswith("deepspeed"):
            import deepspeed as framework
        else:
            import slipstream as framework  # type: ignore[no-redef]
        model = build_model(a.kind, a.shape, a.device)
        row.params = sum(p.numel() for p in model.parameters())
        fpt = flops_per_token(model, a.shape)
        config = slipstream_config(a, 2 if offload else 1, offload)
        engine, *_ = framework.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
        if compile_:
            engine.compile(backend=a.backend)
        x = _batch(a)

        def step() -> torch.Tensor:
            loss = loss_of(a.kind, engine, x)
            engine.backward(loss)
            engine.step()
            return loss

        seconds, loss = timed_steps(step, a.device, a.warmup, a.steps)
        _finish(row, seconds, loss, fpt, a.peak_tflops)
        if hasattr(engine, "destroy"):
            engine.destroy()
    return row


# ------------------------------------------------------------------------- the driver
def _peak_tflops(device: torch.device) -> tuple[str, float]:
    if device.type != "cuda":
        return "cpu", 0.0
    from slipstream.accelerator.peaks import data_sheet_peak

    name = torch.cuda.get_device_name()
    peak = data_sheet_peak(name, torch.bfloat16)  # slipstream's one data-sheet table
    return name, (peak or 0.0) / 1e12


def measured_matmul_tflops(device: torch.device) -> float:
    """One 8192^3 bf16 matmul, median of 10 after warm-up (random data)."""
    if device.type != "cuda":
        return math.nan
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * 8192**3 / statistics.median(times) / 1e12


def _setup_single_process() -> None:
    for key, value in {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(29500 + os.getpid() % 1000),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
    }.items():
        os.environ.setdefault(key, value)


def worker(args: argparse.Namespace) -> None:
    """Run the rows of one process and write their records as JSON lines."""
    _setup_single_process()
    if args.dry_run:  # run the offload code path although states are in host memory anyway
        os.environ["SLIPSTREAM_FORCE_CPU_OFFLOAD"] = "1"
    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(0)
        torch.backends.cuda.matmul.allow_tf32 = True
    _, peak = _peak_tflops(device)
    kind, size = args.model.split("-")
    shape = _MODELS["tiny" if args.dry_run else size]
    if args.micro_batch and not args.dry_run:
        shape = replace(shape, micro_batch=args.micro_batch)
    a = RunArgs(kind, shape, device, args.warmup, args.steps, args.backend, peak)
    for name in args.rows:
        if name.startswith("torch"):
            row = run_torch(a, name)
        else:
            offload = name.endswith("offload")
            row = run_engine(a, name, offload=offload, compile_=not offload)
        row.model = args.model
        print(json.dumps(asdict(row)), flush=True)
        with open(args.json, "a") as f:  # row by row: a later timeout keeps this one
            f.write(json.dumps(asdict(row)) + "\n")


def _launch(
    args: argparse.Namespace, model: str, rows: list[str], out: Path, timeout: float
) -> list[dict[str, Any]]:
    record = out / f"{model}.{'_'.join(rows)}.jsonl"
    record.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "benchmarks.gpu_train", "--worker", "--model", model]
    cmd += ["--rows", *rows, "--json", str(record), "--warmup", str(args.warmup)]
    steps = args.offload_steps if rows[0].endswith("offload") else args.steps
    cmd += ["--steps", str(steps), "--backend", args.backend]
    cmd += ["--micro-batch", str(args.micro_batch)]
    if args.dry_run:
        cmd.append("--dry-run")
    t0 = time.perf_counter()
    try:
        subprocess.run(cmd, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        print(f"[gpu_train] {model} {rows}: timed out after {timeout:.0f} s", flush=True)
    print(f"[gpu_train] {model} {rows}: {time.perf_counter() - t0:.0f} s", flush=True)
    done = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
    missing = [r for r in rows if r not in {d["name"] for d in done}]
    return done + [
        {"name": r, "model": model, "error": "process died or timed out"} for r in missing
    ]


def _fmt(value: Any, spec: str) -> str:
    return (
        "-"
        if value is None or (isinstance(value, float) and math.isnan(value))
        else format(value, spec)
    )


def print_table(rows: list[dict[str, Any]], card: str, matmul: float, peak: float) -> None:
    print(
        f"\ncard: {card}; datasheet bf16 peak {peak:.0f} TFLOP/s; measured 8192^3 matmul "
        f"{_fmt(matmul, '.0f')} TFLOP/s"
    )
    head = f"{'model':<10} {'row':<19} {'params':>7} {'step s':>7} {'tok/s':>9} {'TFLOP/s':>8} {'MFU %':>6} {'GPU GiB':>8} {'host GiB':>8} {'loss':>7}"
    print(head)
    base: dict[str, float] = {}
    for r in rows:
        if r.get("error"):
            print(f"{r['model']:<10} {r['name']:<19} error: {r['error'][:160]}")
            continue
        print(
            f"{r['model']:<10} {r['name']:<19} {r['params'] / 1e9:6.2f}B {_fmt(r['step_s'], '7.3f')} "
            f"{_fmt(r['tokens_per_s'], '9.0f')} {_fmt(r['tflops'], '8.1f')} {_fmt(r['mfu'], '6.1f')} "
            f"{_fmt(r['peak_gib'], '8.1f')} {_fmt(r['host_peak_gib'], '8.1f')} {_fmt(r['loss'], '7.3f')}"
        )
        base.setdefault(r["model"], r["tokens_per_s"])
    print("\nratios (tokens/s over the model's first row):")
    for r in rows:
        if not r.get("error") and r["model"] in base:
            print(f"  {r['model']:<10} {r['name']:<19} {r['tokens_per_s'] / base[r['model']]:.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--models", nargs="*", default=["gpt-1b", "llama-1b"])
    p.add_argument("--offload-model", default="gpt-3b", help="'' skips the offload rows")
    p.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeed's offload row")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=5, help="timed steps per window (3 windows)")
    p.add_argument("--offload-steps", type=int, default=2, help="--steps of the offload rows")
    p.add_argument("--backend", default="inductor", help="torch.compile backend")
    p.add_argument("--micro-batch", type=int, default=0, help="override the shapes' micro batch")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per process")
    p.add_argument("--out", default="runs/gpu_train")
    p.add_argument("--dry-run", action="store_true", help="tiny models on the CPU")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--rows", nargs="*", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    card, peak = _peak_tflops(device)
    matmul = measured_matmul_tflops(device)
    print(
        f"[gpu_train] card {card}, torch {torch.__version__}, matmul {_fmt(matmul, '.0f')} TFLOP/s",
        flush=True,
    )
    rows: list[dict[str, Any]] = []
    compute = ["slipstream", "torch-amp", "torch-bf16"]
    # The first model, the offload rows, then the other models: the most telling rows first.
    for model in args.models[:1]:
        rows += _launch(args, model, compute, out, args.timeout)
    if args.offload_model:
        rows += _launch(args, args.offload_model, ["slipstream-offload"], out, args.timeout)
        if not args.no_deepspeed:
            rows += _launch(args, args.offload_model, ["deepspeed-offload"], out, args.timeout)
    for model in args.models[1:]:
        rows += _launch(args, model, compute, out, args.timeout)
    (out / "summary.json").write_text(
        json.dumps({"card": card, "matmul_tflops": matmul, "rows": rows}, indent=1)
    )
    print_table(rows, card, matmul, peak)


if __name__ == "__main__":
    main()
