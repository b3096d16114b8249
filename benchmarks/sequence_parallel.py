"""Sequence parallelism: communication per rank per layer vs the papers' formulas, and peak
activation memory per rank, for P = 1, 2, 4 sequence-parallel ranks.

Communication (from the comm logger, ``slipstream.distributed.comm``): one forward and one
backward of a GPT with ``--layers`` blocks of multi-head attention; the all-to-all (Ulysses) or
all-gather + reduce-scatter (LSS) bytes and calls on the ``sp`` axis are divided by the number
of layers. The counter records a rank's whole message (its own chunk included), so Ulysses'
forward should read exactly 4 (N/P) b h x 4 bytes (the paper's 4Nh/P with h = hidden size),
and a rank really sends (P-1)/P of it over links. Two sweeps: N fixed (volume falls as 1/P)
and N = N0 x P (volume constant: the Ulysses claim). LSS: 1 all-gather forward and
1 reduce-scatter backward per layer, each of the full gathered [K|V] (2 N b h x 4 bytes
counted, (P-1)/P received).

Memory: exact peak of tensor bytes allocated during one forward (what autograd keeps: the
activations) and during forward + backward, per rank, at a fixed N, by
``slipstream.science._memory.TensorMemoryTracker`` (CPU has no allocator statistics).
Parameters exist before the region and are not counted; parameter gradients are (same for
every P).

    python benchmarks/sequence_parallel.py                 # N=1024, hidden 256, 8 heads, 2 layers
    python benchmarks/sequence_parallel.py --seq 2048 --degrees 1,2 --json sp.json
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks._harness import BenchConfig, spawn_world

FP32 = 4


def _model(args: argparse.Namespace, method: str, seq: int) -> Any:
    from slipstream.models import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(
        hidden_size=args.hidden,
        num_heads=args.heads,
        num_kv_heads=args.heads,
        num_layers=args.layers,
        max_seq_len=seq,
        sequence_parallel=method,
    )
    return GPT(cfg)


def _batch(seq: int, batch: int, p: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 256, (batch, seq + 1), generator=torch.Generator().manual_seed(1))
    seg = slice(rank * seq // p, (rank + 1) * seq // p)
    return tokens[:, :-1][:, seg], tokens[:, 1:][:, seg]


def _comm(args: argparse.Namespace, method: str, seq: int, group: Any) -> dict[str, Any]:
    from slipstream.distributed import comm
    from slipstream.sequence import parallelize_sequence_

    p, rank = comm.get_world_size(group), comm.get_rank(group)
    model = parallelize_sequence_(_model(args, method, seq), group)
    x, y = _batch(seq, args.batch, p, rank)
    comm.comm_counters.reset()
    loss = model(x, y)
    fwd = {op: (s.calls, s.bytes) for (ax, op), s in comm.comm_counters.stats.items() if ax == "sp"}
    comm.comm_counters.reset()
    loss.backward()
    bwd = {op: (s.calls, s.bytes) for (ax, op), s in comm.comm_counters.stats.items() if ax == "sp"}
    return {"fwd": fwd, "bwd": bwd}


def _memory(args: argparse.Namespace, method: str, group: Any) -> dict[str, int]:
    from slipstream.distributed import comm
    from slipstream.science._memory import TensorMemoryTracker
    from slipstream.sequence import parallelize_sequence_

    p, rank = comm.get_world_size(group), comm.get_rank(group)
    model = parallelize_sequence_(_model(args, method, args.seq), group)
    x, y = _batch(args.seq, args.batch, p, rank)
    model(x, y).backward()  # warm up (lazy state), then measure a clean step
    model.zero_grad(set_to_none=True)
    with TensorMemoryTracker() as fwd_mem:
        loss = model(x, y)
    with TensorMemoryTracker() as step_mem:
        loss = model(x, y)
        loss.backward()
    return {"forward_peak": fwd_mem.peak_bytes, "step_peak": step_mem.peak_bytes}


def _rank_body(args: argparse.Namespace, rank: int, device: torch.device) -> dict[str, Any]:
    from slipstream.distributed.mesh import ParallelDims, build_mesh

    world = torch.distributed.get_world_size()
    mesh = build_mesh(ParallelDims(world_size=world, sp=world), device_type="cpu")
    group = mesh.get_group("sp")
    out: dict[str, Any] = {"comm": {}, "memory": {}}
    for method in ("ulysses", "lss"):
        out["comm"][method] = {
            "fixed": _comm(args, method, args.seq, group),
            "scaled": _comm(args, method, args.seq_per_rank * world, group),
        }
        out["memory"][method] = _memory(args, method, group)
    return out


def _ops(record: dict[str, Any], layers: int) -> dict[str, tuple[float, float]]:
    return {op: (c / layers, b / layers) for op, (c, b) in record.items()}


def _row(args: argparse.Namespace, p: int, seq: int, rec: dict[str, Any]) -> list[str]:
    """Ulysses: counted forward bytes per layer next to 4 (N/P) b h x 4."""
    fwd = _ops(rec["fwd"], args.layers).get("all_to_all", (0.0, 0.0))
    bwd = _ops(rec["bwd"], args.layers).get("all_to_all", (0.0, 0.0))
    formula = 4 * seq * args.batch * args.hidden * FP32 / p
    sent = fwd[1] * (p - 1) / p
    return [
        f"{p}",
        f"{seq}",
        f"{fwd[0]:.0f}+{bwd[0]:.0f}",
        f"{fwd[1] / 2**10:.1f}",
        f"{formula / 2**10:.1f}" if p > 1 else f"({formula / 2**10:.1f})",
        f"{sent / 2**10:.1f}",
        f"{bwd[1] / 2**10:.1f}",
    ]


def _lss_row(args: argparse.Namespace, p: int, seq: int, rec: dict[str, Any]) -> list[str]:
    fwd = _ops(rec["fwd"], args.layers)
    bwd = _ops(rec["bwd"], args.layers)
    gather, rs = fwd.get("all_gather", (0.0, 0.0)), bwd.get("reduce_scatter", (0.0, 0.0))
    formula = 2 * (p - 1) * (seq / p) * args.batch * args.hidden * FP32
    return [
        f"{p}",
        f"{seq}",
        f"{gather[0]:.0f}+{rs[0]:.0f}",
        f"{gather[1] / 2**10:.1f}",
        f"{gather[1] * (p - 1) / p / 2**10:.1f}",
        f"{formula / 2**10:.1f}",
    ]


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def report(args: argparse.Namespace, results: dict[int, dict[str, Any]]) -> str:
    """The three tables (Ulysses comm, LSS comm, memory) as text."""
    out = [
        f"GPT hidden h={args.hidden}, {args.heads} heads (MHA), {args.layers} layers, batch "
        f"b={args.batch}, fp32; KiB per rank per layer (comm logger, sp axis)",
        "",
        "Ulysses all-to-all: counted = the rank's message incl. its own chunk; "
        "formula 4Nh/P = 4 (N/P) b h x 4 B (P=1: no communication, formula in parentheses)",
    ]
    head = ["P", "N", "calls f+b", "fwd KiB", "4Nh/P KiB", "sent KiB", "bwd KiB"]
    rows = []
    for sweep in ("fixed", "scaled"):
        for p, res in results.items():
            seq = args.seq if sweep == "fixed" else args.seq_per_rank * p
            rows.append(_row(args, p, seq, res["comm"]["ulysses"][sweep]))
    out += [_table(head, rows), ""]
    out.append(
        "LSS: fused [K|V] all-gather forward + reduce-scatter backward per layer; "
        "received = (P-1)/P of the gathered bytes; formula 2 (P-1) (N/P) b h x 4 B"
    )
    head = ["P", "N", "calls f+b", "gathered KiB", "received KiB", "formula KiB"]
    rows = [_lss_row(args, p, args.seq, res["comm"]["lss"]["fixed"]) for p, res in results.items()]
    out += [_table(head, rows), ""]
    out.append(f"peak tensor memory per rank (MiB) at N={args.seq}; ratio to P=1 in brackets")
    head = ["P", "ulysses fwd", "ulysses fwd+bwd", "lss fwd", "lss fwd+bwd"]
    rows = []
    for p, res in results.items():
        row = [str(p)]
        for method in ("ulysses", "lss"):
            for key in ("forward_peak", "step_peak"):
                v = max(r[method][key] for r in res["memory_all"])
                b0 = max(r[method][key] for r in results[min(results)]["memory_all"])
                row.append(f"{v / 2**20:.1f} [{v / b0:.2f}]")
        rows.append(row)
    out.append(_table(head, rows))
    return "\n".join(out)


def run(args: argparse.Namespace) -> dict[int, dict[str, Any]]:
    results: dict[int, dict[str, Any]] = {}
    for p in args.degrees:
        cfg = BenchConfig(world=p, timeout_s=args.timeout)
        outcome = spawn_world(f"sp{p}", cfg, partial(_rank_body, args))
        if outcome.error:
            raise RuntimeError(f"P={p} failed: {outcome.error}\n{outcome.detail}")
        results[p] = dict(outcome.records[0])
        results[p]["memory_all"] = [r["memory"] for r in outcome.records]
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=1024, help="N of the fixed-N sweep and memory")
    p.add_argument("--seq-per-rank", type=int, default=256, help="N/P of the N = N0 x P sweep")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--degrees", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", default=None, help="write the raw per-rank records here")
    args = p.parse_args(argv)
    results = run(args)
    print(report(args, results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({str(k): v for k, v in results.items()}, f, indent=1)


if __name__ == "__main__":
    main()
