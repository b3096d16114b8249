"""Tiled Evoformer attention vs the naive formula: time and peak memory, forward and backward.

Usage::

    python benchmarks/evoformer.py [--n-seq 32] [--lengths 256,512] [--heads 8] [--dim 32]
        [--batch 1] [--dtype float32] [--reps 5] [--threads 1]
        [--tiles 64x128x16,128x64x8] [--device cpu] [--json out.json]

Shapes are AlphaFold2 MSA row attention with pair bias (Q/K/V [B, N_seq, L, H, D], a mask
bias [B, N_seq, 1, 1, L] with the last eighth of the keys masked at -1e9, a trainable pair
bias [B, 1, H, L, L]), scaled to the machine: AF2 trains with N_seq=128, L=256-384, H=8,
D=32. Every row computes the same forward and the gradients of Q, K, V and the pair bias.

* **Time**: forward alone and forward + backward, wall clock (``synchronize`` on an
  accelerator). Runs are interleaved (naive, tiled config 1, tiled config 2, ..., repeat) so
  load on a shared machine hits every row alike; the table gives medians over ``--reps``
  and the median of the per-rep ratios to naive.
* **Peak memory**: exact peak of live tensor bytes allocated inside forward + backward
  (``slipstream.science._memory.TensorMemoryTracker``: every storage an op creates counts
  until it is freed; inputs and the incoming output gradient are excluded, returned
  gradients included). Deterministic; measured in separate untimed runs.
* **Peers**: DeepSpeed's ``DS4Sci_EvoformerAttention`` runs as a row when it imports and the
  device is CUDA (it is a CUTLASS kernel and needs a GPU); otherwise its row says why not.

``--tiles QxKVxN,...`` lists tile configurations (query rows x key rows x N entries per step)
to compare; the default is the library's defaults.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from slipstream.science import evoformer_attention, evoformer_attention_reference
from slipstream.science._memory import TensorMemoryTracker
from slipstream.science.attention import DEFAULT_KV_TILE, DEFAULT_N_TILE, DEFAULT_Q_TILE

__all__ = ["main"]

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]], torch.Tensor]


@dataclass
class Row:
    """One implementation at one sequence length."""

    name: str
    length: int
    fwd_ms: list[float] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)
    fwd_peak_bytes: int = 0
    step_peak_bytes: int = 0
    error: str = ""


def _inputs(args: argparse.Namespace, length: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    dtype, device = getattr(torch, args.dtype), torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    shape = (args.batch, args.n_seq, length, args.heads, args.dim)

    def randn(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=g).to(device=device, dtype=dtype)

    q, k, v = (randn(*shape).requires_grad_() for _ in range(3))
    mask = torch.zeros(args.batch, args.n_seq, 1, 1, length)
    mask[..., length - length // 8 :] = -1e9  # padded residues, as OpenFold's mask bias
    pair = randn(args.batch, 1, args.heads, length, length).requires_grad_()
    return [q, k, v, mask.to(device=device, dtype=dtype), pair], randn(*shape)


def _sync(device: str) -> None:
    if device != "cpu":
        torch.get_device_module(device).synchronize()


def _step(fn: Attention, tensors: list[torch.Tensor], grad: torch.Tensor, backward: bool) -> None:
    q, k, v, mask, pair = tensors
    if not backward:
        with torch.no_grad():
            fn(q, k, v, [mask, pair])
        return
    out = fn(q, k, v, [mask, pair])
    torch.autograd.grad(out, (q, k, v, pair), grad)


def _peak(fn: Attention, tensors: list[torch.Tensor], grad: torch.Tensor, backward: bool) -> int:
    with TensorMemoryTracker() as mem:
        _step(fn, tensors, grad, backward)
    return mem.peak_bytes


def _timed(
    fn: Attention, tensors: list[torch.Tensor], grad: torch.Tensor, args: Any
) -> tuple[float, float]:
    times = []
    for backward in (False, True):
        _sync(args.device)
        start = time.perf_counter()
        _step(fn, tensors, grad, backward)
        _sync(args.device)
        times.append((time.perf_counter() - start) * 1e3)
    return times[0], times[1]


def _deepspeed() -> tuple[Attention | None, str]:
    if not torch.cuda.is_available():
        return None, "unavailable (DS4Sci_EvoformerAttention is a CUDA kernel; no GPU here)"
    try:
        from deepspeed.ops.deepspeed4science import DS4Sci_EvoformerAttention
    except Exception as exc:  # ImportError, or a failed kernel build
        return None, f"unavailable ({type(exc).__name__}: {str(exc).splitlines()[0][:80]})"
    return DS4Sci_EvoformerAttention, ""


def _candidates(args: argparse.Namespace) -> tuple[dict[str, Attention], dict[str, str]]:
    fns: dict[str, Attention] = {"naive": evoformer_attention_reference}
    for spec in args.tiles.split(","):
        tq, tk, tn = (int(x) for x in spec.lower().split("x"))

        def tiled(q: Any, k: Any, v: Any, b: Any, tq: int = tq, tk: int = tk, tn: int = tn) -> Any:
            return evoformer_attention(q, k, v, b, q_tile=tq, kv_tile=tk, n_tile=tn)

        fns[f"tiled {tq}x{tk}x{tn}"] = tiled
    skipped = {}
    ds_fn, why = _deepspeed() if args.device != "cpu" else (None, "")
    if ds_fn is not None:
        fns["deepspeed"] = ds_fn
    else:
        skipped["deepspeed"] = why or "unavailable (CUDA kernel; run with --device cuda on a GPU)"
    return fns, skipped


def run_length(args: argparse.Namespace, length: int) -> list[Row]:
    """All implementations at one length: memory first (untimed), then interleaved timing."""
    tensors, grad = _inputs(args, length)
    fns, skipped = _candidates(args)
    rows = {name: Row(name, length) for name in fns}
    for name, fn in fns.items():
        try:
            rows[name].fwd_peak_bytes = _peak(fn, tensors, grad, backward=False)
            rows[name].step_peak_bytes = _peak(fn, tensors, grad, backward=True)
            _timed(fn, tensors, grad, args)  # warm-up
        except Exception as exc:  # report in the row, keep the other rows
            rows[name].error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
    for _ in range(args.reps):
        for name, fn in fns.items():
            if not rows[name].error:
                fwd, step = _timed(fn, tensors, grad, args)
                rows[name].fwd_ms.append(fwd)
                rows[name].step_ms.append(step)
    out = list(rows.values())
    out += [Row(name, length, error=why) for name, why in skipped.items()]
    return out


def _ratio(row: Row, base: Row, attr: str) -> float:
    mine, ref = getattr(row, attr), getattr(base, attr)
    return statistics.median(a / b for a, b in zip(mine, ref))


def format_table(rows: list[Row]) -> str:
    """Medians and ratios to the naive row of the same length (below 1 is better)."""
    head = (
        f"{'L':>5} {'impl':<18} {'fwd ms':>8} {'fwd+bwd ms':>11} {'t/naive':>8} "
        f"{'fwd MB':>8} {'fwd+bwd MB':>11} {'naive/mem':>10}"
    )
    lines = [head, "-" * len(head)]
    naive = {r.length: r for r in rows if r.name == "naive"}
    for r in rows:
        if r.error:
            lines.append(f"{r.length:>5} {r.name:<18} {r.error}")
            continue
        base = naive[r.length]
        mb = 2**20
        lines.append(
            f"{r.length:>5} {r.name:<18} {statistics.median(r.fwd_ms):>8.1f} "
            f"{statistics.median(r.step_ms):>11.1f} {_ratio(r, base, 'step_ms'):>8.2f} "
            f"{r.fwd_peak_bytes / mb:>8.1f} {r.step_peak_bytes / mb:>11.1f} "
            f"{base.step_peak_bytes / max(r.step_peak_bytes, 1):>10.1f}"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--n-seq", type=int, default=32, help="N: sequences (row attention)")
    p.add_argument("--lengths", default="256,512", help="L values (residues), comma-separated")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=32, help="D: head width")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--reps", type=int, default=5, help="timed repetitions (medians)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads on CPU")
    p.add_argument(
        "--tiles",
        default=f"{DEFAULT_Q_TILE}x{DEFAULT_KV_TILE}x{DEFAULT_N_TILE}",
        help="tile configs QxKVxN, comma-separated",
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default="", help="write every measurement to this path")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[Row]:
    args = parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    print(
        f"B={args.batch} N={args.n_seq} H={args.heads} D={args.dim} {args.dtype} "
        f"on {args.device} ({torch.get_num_threads()} threads), {args.reps} reps"
    )
    rows: list[Row] = []
    for length in (int(x) for x in args.lengths.split(",")):
        rows += run_length(args, length)
    print(format_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return rows


if __name__ == "__main__":
    main()
