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

Strong scaling (``--scaling``): one training step (forward, backward, SGD step through
``slipstream.initialize``) of a LLaMA-shaped Hugging Face model at one sequence length, on
1 rank and on 2 ranks with Ulysses and with ring attention, every rank on one thread
(``torch.set_num_threads(1)``). Per step: the wall time (the slowest rank, steps started
together at a barrier) and each process's CPU time (``time.process_time``: all its threads,
gloo's included; waiting for a peer costs none). Medians with the 10th-90th percentile spread
and the ratio SP=2 / SP=1 of the medians (goal: at most 0.6). ``--rounds`` alternates the
worlds so a load that drifts affects both. On a shared machine only the CPU clock means
anything; the wall ratio needs a quiet machine with a core per rank.

    python benchmarks/sequence_parallel.py                 # N=1024, hidden 256, 8 heads, 2 layers
    python benchmarks/sequence_parallel.py --seq 2048 --degrees 1,2 --json sp.json
    python benchmarks/sequence_parallel.py --scaling --seq 4096 --steps 10 --rounds 2

Training parity at 4 ranks (``--parity``): a tiny LLaMA (4 heads, 2 KV heads, fp32) trains
3 SGD steps through ``initialize`` at SP=4 as Ulysses 4 (KV heads replicated), ring 4 and
Ulysses 2 x ring 2 (``sequence_parallel_ring_size: 2``), each against one process on the same
global batches (computed on rank 0); prints the largest loss and parameter differences.
``--parity-model qwen2``: a tiny Qwen2 with 1 KV head instead (GQA with fewer KV heads than P).

    python benchmarks/sequence_parallel.py --parity [--parity-model qwen2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
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


# ------------------------------------------------------------------ strong scaling
def _llama(args: argparse.Namespace) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=args.vocab,
            hidden_size=args.hidden,
            intermediate_size=args.hidden * 11 // 4,
            num_hidden_layers=args.layers,
            num_attention_heads=args.heads,
            num_key_value_heads=max(1, args.heads // 2),
            max_position_embeddings=args.seq,
            attn_implementation="sdpa",
        )
    )


def _scaling_body(args: argparse.Namespace, mode: str, rank: int, device: Any) -> dict[str, Any]:
    """One rank: ``args.warmup`` + ``args.steps`` training steps; per-step wall and CPU ms."""
    import torch.distributed as dist

    import slipstream
    from slipstream.sequence import shard_causal_lm_batch, shard_causal_lm_batch_ring

    torch.set_num_threads(1)
    p = dist.get_world_size()
    cfg: dict[str, Any] = {
        "train_batch_size": args.batch,
        "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
        "sequence_parallel_size": p,
    }
    if p > 1:
        cfg["sequence_parallel_mode"] = mode
    engine, *_ = slipstream.initialize(model=_llama(args), config=cfg)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    batch: dict[str, Any] = {"input_ids": ids, "labels": ids.clone()}
    if p > 1:
        cut = shard_causal_lm_batch_ring if mode == "ring" else shard_causal_lm_batch
        batch = cut(batch, p, rank)
    wall, cpu, losses = [], [], []
    for step in range(args.warmup + args.steps):
        dist.barrier()
        w0, c0 = time.perf_counter(), time.process_time()
        out = engine(**batch)
        engine.backward(out.loss)
        engine.step()
        w1, c1 = time.perf_counter(), time.process_time()
        losses.append(float(out.loss.detach()))
        if step >= args.warmup:
            wall.append((w1 - w0) * 1e3)
            cpu.append((c1 - c0) * 1e3)
    engine.destroy()
    return {"wall_ms": wall, "cpu_ms": cpu, "losses": losses, "threads": torch.get_num_threads()}


def _stats(values: list[float]) -> tuple[float, float, float]:
    """Median, 10th and 90th percentile."""
    if len(values) < 2:
        return values[0], values[0], values[0]
    q = statistics.quantiles(values, n=10, method="inclusive")
    return statistics.median(values), q[0], q[-1]


def run_scaling(args: argparse.Namespace) -> dict[str, Any]:
    """Alternate the worlds (1 rank; 2 ranks Ulysses; 2 ranks ring) ``args.rounds`` times;
    per configuration the step times of all rounds (wall: slowest rank of each step; CPU:
    each rank's, pooled)."""
    runs = [("single", 1), *((m, 2) for m in args.modes)]
    times: dict[str, dict[str, list[float]]] = {n: {"wall": [], "cpu": []} for n, _ in runs}
    loads = [os.getloadavg()[0]]
    first_loss: dict[str, float] = {}
    for _ in range(args.rounds):
        for name, p in runs:
            cfg = BenchConfig(world=p, timeout_s=args.timeout)
            outcome = spawn_world(f"scale-{name}", cfg, partial(_scaling_body, args, name))
            if outcome.error:
                raise RuntimeError(f"{name} P={p} failed: {outcome.error}\n{outcome.detail}")
            recs = outcome.records
            times[name]["wall"] += [max(w) for w in zip(*(r["wall_ms"] for r in recs))]
            times[name]["cpu"] += [c for r in recs for c in r["cpu_ms"]]
            first_loss[name] = recs[0]["losses"][0]
            loads.append(os.getloadavg()[0])
    return {"times": times, "loads": loads, "first_loss": first_loss}


def scaling_report(args: argparse.Namespace, res: dict[str, Any]) -> str:
    times, loads = res["times"], res["loads"]
    out = [
        f"strong scaling: LLaMA-shaped HF model (hidden {args.hidden}, {args.layers} layers, "
        f"{args.heads} heads / {max(1, args.heads // 2)} KV, vocab {args.vocab}), fp32, batch "
        f"{args.batch}, seq {args.seq}, SGD; one thread per rank; {args.steps} timed steps "
        f"after {args.warmup} x {args.rounds} rounds; 1-min load average "
        f"{min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} CPUs",
        "first-step loss (same model and tokens; equal up to fp32 summation order): "
        + ", ".join(f"{k} {v:.5f}" for k, v in res["first_loss"].items()),
    ]
    head = ["run", "P", "wall ms median [p10-p90]", "cpu ms median [p10-p90]", "wall/P=1",
            "cpu/P=1"]  # fmt: skip
    base = {clock: _stats(times["single"][clock])[0] for clock in ("wall", "cpu")}
    rows = []
    for name, rec in times.items():
        w, c = _stats(rec["wall"]), _stats(rec["cpu"])
        rows.append([
            name, "1" if name == "single" else "2",
            f"{w[0]:.0f} [{w[1]:.0f}-{w[2]:.0f}]", f"{c[0]:.0f} [{c[1]:.0f}-{c[2]:.0f}]",
            f"{w[0] / base['wall']:.2f}", f"{c[0] / base['cpu']:.2f}",
        ])  # fmt: skip
    out.append(_table(head, rows))
    out.append("goal: SP=2 step time <= 0.60 x SP=1 (wall clock on a quiet machine)")
    return "\n".join(out)


# ------------------------------------------------------------------ 4-rank parity
PARITY_RUNS = {
    "ulysses 4": ("ulysses", None),
    "ring 4": ("ring", None),
    "ulysses 2 x ring 2": ("ring", 2),
}


def _parity_body(family: str, rank: int, device: Any) -> dict[str, Any]:
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    import slipstream
    from slipstream.sequence import shard_causal_lm_batch, shard_causal_lm_batch_ring

    torch.set_num_threads(1)
    p, steps, batch, seq, lr = dist.get_world_size(), 3, 2, 32, 0.5

    def model() -> Any:
        torch.manual_seed(0)
        config_cls, model_cls, kv = (
            (LlamaConfig, LlamaForCausalLM, 2) if family == "llama" else
            (Qwen2Config, Qwen2ForCausalLM, 1)  # 1 KV head: replicated 4x by Ulysses 4
        )  # fmt: skip
        return model_cls(config_cls(
            vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=kv, max_position_embeddings=64,
            tie_word_embeddings=False, attn_implementation="sdpa",
        ))  # fmt: skip

    g = torch.Generator().manual_seed(3)
    data = torch.randint(0, 64, (steps, batch, seq), generator=g)
    labels = data.clone()
    labels[:, 0, :7] = -100  # the shards count different numbers of tokens
    out: dict[str, Any] = {}
    if rank == 0:  # the single-process reference
        ref = model()
        opt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=0.9)
        losses = []
        for i in range(steps):
            loss = ref(input_ids=data[i], labels=labels[i]).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
        out["reference"] = {"losses": losses}
        ref_params = {n: q.detach() for n, q in ref.named_parameters()}
    for name, (mode, ring) in PARITY_RUNS.items():
        cfg: dict[str, Any] = {
            "train_batch_size": batch,
            "optimizer": {"type": "SGD", "params": {"lr": lr, "momentum": 0.9}},
            "sequence_parallel_size": p,
            "sequence_parallel_mode": mode,
            "gradient_clipping": 0.0,
        }
        if ring is not None:
            cfg["sequence_parallel_ring_size"] = ring
        engine, *_ = slipstream.initialize(model=model(), config=cfg)
        losses = []
        for i in range(steps):
            full = {"input_ids": data[i], "labels": labels[i]}
            if mode == "ring":
                part = shard_causal_lm_batch_ring(full, p, rank, ring_size=ring or p)
            else:
                part = shard_causal_lm_batch(full, p, rank)
            loss = engine(**part).loss
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
        if rank == 0:
            diff = max(
                (q.detach() - ref_params[n]).abs().max().item()
                for n, q in engine.module.named_parameters()
            )
            attn = engine.module.config._attn_implementation
            out[name] = {"losses": losses, "max_param_diff": diff, "attn": attn}
        engine.destroy()
    return out


def run_parity(args: argparse.Namespace) -> str:
    body = partial(_parity_body, args.parity_model)
    outcome = spawn_world("sp-parity4", BenchConfig(world=4, timeout_s=args.timeout), body)
    if outcome.error:
        raise RuntimeError(f"parity failed: {outcome.error}\n{outcome.detail}")
    rec = outcome.records[0]
    ref = rec["reference"]["losses"]
    shape = (
        "LLaMA (4 heads, 2 KV heads)"
        if args.parity_model == "llama"
        else "Qwen2 (4 heads, 1 KV head)"
    )
    lines = [
        f"SP=4 on 4 gloo ranks vs one process: tiny {shape}, fp32, 3 SGD "
        "steps (lr 0.5, momentum 0.9), batch 2 x 32 tokens",
        f"reference losses: {', '.join(f'{x:.6f}' for x in ref)}",
    ]
    for name in PARITY_RUNS:
        got = rec[name]
        rel = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref))
        lines.append(
            f"{name:>20}: max loss rel diff {rel:.2e}, max param abs diff "
            f"{got['max_param_diff']:.2e} (attention {got['attn']})"
        )
    return "\n".join(lines)


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
    p.add_argument("--scaling", action="store_true", help="strong scaling: SP=2 vs SP=1 time")
    p.add_argument("--vocab", type=int, default=1024, help="--scaling: vocabulary size")
    p.add_argument("--steps", type=int, default=8, help="--scaling: timed steps per round")
    p.add_argument("--warmup", type=int, default=2, help="--scaling: untimed steps per round")
    p.add_argument("--rounds", type=int, default=1, help="--scaling: alternations of worlds")
    p.add_argument("--modes", type=lambda s: s.split(","), default=["ulysses", "ring"])
    p.add_argument("--parity", action="store_true", help="SP=4 training parity (4 ranks)")
    p.add_argument("--parity-model", choices=["llama", "qwen2"], default="llama")
    args = p.parse_args(argv)
    if args.parity:
        print(run_parity(args))
        return
    if args.scaling:
        res = run_scaling(args)
        print(scaling_report(args, res))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
        return
    results = run(args)
    print(report(args, results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({str(k): v for k, v in results.items()}, f, indent=1)


if __name__ == "__main__":
    main()
