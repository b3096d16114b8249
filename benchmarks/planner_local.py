"""The planner against this machine: predicted vs measured per-rank memory and step time of the
reference GPT under several layouts, in one run.

1. ``slipstream plan --calibrate --nproc WORLD`` measures this machine into a ``local`` profile
   (in a temporary cache directory): GEMM rate, memory bandwidth and all-reduce of WORLD ranks
   running at once.
2. Every layout trains ``slipstream.models.GPT`` in fp32 (AdamW) in a fresh world of WORLD gloo
   ranks, through ``slipstream.initialize`` with the config the planner exports for it
   (``layout_to_config``; pipelines as ``gpt_pipeline_layers``), on the same global batch.
3. Memory: the peak of live tensor bytes on the rank (every allocation and free of PyTorch's
   CPU allocator, recorded by ``torch.profiler`` with ``profile_memory``) during the second
   optimizer step, counted from before the model is built: model states + activations +
   buffers, what the planner predicts. The largest rank is reported. RSS growth over the
   timed steps is printed beside it for reference (it adds the allocator's cached pages,
   gloo's buffers and Python objects, which the planner does not model).
4. Time: the slowest rank's median optimizer step over ``--steps`` timed steps (a barrier
   before each), after the profiled steps and ``--warmup`` more.
5. The planner predicts each layout with the calibrated profile (``param_bytes=4``: fp32
   weights and activations, no master copy). Nothing is fitted per row.

    python benchmarks/planner_local.py                  # world 4, every layout
    python benchmarks/planner_local.py --write-docs     # and the table into docs/planner.md

The machine is shared (a 2-core CPU with other jobs): the load average is printed before and
after, and step times move with it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist

from benchmarks._harness import BenchConfig, PeakMemory, spawn_world
from slipstream.distributed.mesh import dp_group
from slipstream.models.gpt import GPT, GPTConfig
from slipstream.models.gpt_pipeline import gpt_loss, gpt_pipeline_layers
from slipstream.planner import Layout, from_gpt_config, load_hardware, predict
from slipstream.planner.export import layout_to_config

_MB = 2**20
_DOCS = Path(__file__).resolve().parents[1] / "docs" / "planner.md"
_START, _END = "<!-- local:start -->", "<!-- local:end -->"


@dataclass(frozen=True)
class Case:
    """One layout; ``dp = world / (tp * pp)``."""

    tp: int = 1
    pp: int = 1
    virtual_stages: int = 1
    zero_stage: int = 0
    recompute: str = "none"


CASES: dict[str, Case] = {
    "dp-zero0": Case(),
    "dp-zero1": Case(zero_stage=1),
    "dp-zero2": Case(zero_stage=2),
    "dp-zero3": Case(zero_stage=3),
    "dp-zero0-recompute": Case(recompute="full"),
    "tp2-zero1": Case(tp=2, zero_stage=1),
    "tp2-zero1-recompute": Case(tp=2, zero_stage=1, recompute="full"),
    "pp2-1f1b-zero1": Case(pp=2, zero_stage=1),
    # PP2 x DP2 with recompute stops in slipstream's reducer (a checkpointed pipeline layer's
    # reentrant backward ends the data-parallel reduction early): PP4 has no DP reduction.
    "pp4-1f1b-recompute": Case(pp=4, recompute="full"),
    "pp2-interleaved-zero1": Case(pp=2, virtual_stages=2, zero_stage=1),
}


def _gpt_config(args: argparse.Namespace, recompute: bool = False) -> GPTConfig:
    return GPTConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        max_seq_len=args.seq,
        activation_checkpointing=recompute,
    )


def _layout(case: Case, args: argparse.Namespace) -> Layout:
    return Layout(
        tp=case.tp,
        pp=case.pp,
        dp=args.world // (case.tp * case.pp),
        virtual_stages=case.virtual_stages,
        micro_batch=args.micro,
        global_batch=args.global_batch,
        zero_stage=case.zero_stage,
        recompute=case.recompute,  # type: ignore[arg-type]
        param_bytes=4,
        grad_bytes=4,
    )


def _micro_batches(args: argparse.Namespace, layout: Layout, dp_rank: int) -> list[Any]:
    gen = torch.Generator().manual_seed(1000 + dp_rank)
    out = []
    for _ in range(layout.micro_batches):
        tokens = torch.randint(0, args.vocab, (args.micro, args.seq + 1), generator=gen)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def _live_bytes_peak(prof: Any, since_ns: int) -> int:
    """Peak of live CPU tensor bytes after ``since_ns``, counting every allocation and free
    the profiler saw since it started."""
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and str(e.device_type()) == "DeviceType.CPU"
    )
    live = peak = 0
    for start, nbytes in events:
        live += nbytes
        if start >= since_ns:
            peak = max(peak, live)
    return peak


def _body(case: Case, args: argparse.Namespace, rank: int, device: torch.device) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    import slipstream

    layout = _layout(case, args)
    config = layout_to_config(layout, dtype="fp32")
    config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-4}}
    config["steps_per_print"] = 10**9
    rss = PeakMemory(device)
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    prof.start()
    torch.manual_seed(0)
    train: Any
    if case.pp > 1:
        from slipstream.pipe import PipelineModule

        module = PipelineModule(
            layers=gpt_pipeline_layers(_gpt_config(args)),
            num_stages=case.pp,
            loss_fn=gpt_loss,
            partition_method="parameters",
            virtual_stages=case.virtual_stages,
            activation_checkpoint_interval=1 if case.recompute == "full" else 0,
        )
        engine, *_ = slipstream.initialize(model=module, config=config)
        data = _micro_batches(args, layout, dist.get_rank(dp_group(engine.mesh)))

        def train() -> float:
            return float(engine.train_batch(iter(data)))

    else:
        model = GPT(_gpt_config(args, recompute=case.recompute == "full"))
        engine, *_ = slipstream.initialize(model=model, config=config)
        data = _micro_batches(args, layout, dist.get_rank(dp_group(engine.mesh)))

        def train() -> float:
            for x, y in data:
                loss = engine(x, y)
                engine.backward(loss)
                engine.step()
            return float(loss)

    train()  # the first step creates the optimizer states
    mark = time.time_ns()
    dist.barrier()
    train()
    prof.stop()
    peak = _live_bytes_peak(prof, mark)
    del prof
    for _ in range(args.warmup):
        train()
    rss.reset_peak()
    times = []
    for _ in range(args.steps):
        dist.barrier()
        start = time.perf_counter()
        train()
        times.append(time.perf_counter() - start)
    return {
        "peak_bytes": peak,
        "rss_bytes": max(0, rss.peak_bytes() - rss.baseline),
        "median_s": statistics.median(times),
        "times_s": times,
    }


def _calibrate(world: int, cache: str) -> Any:
    """``slipstream plan --calibrate --nproc world`` into ``cache``, as a user runs it."""
    env = dict(os.environ, SLIPSTREAM_CACHE=cache)
    cmd = [sys.executable, "-m", "slipstream.cli.main", "plan", "--calibrate",
           "--nproc", str(world)]  # fmt: skip
    subprocess.run(cmd, env=env, check=True, timeout=600)
    return load_hardware(Path(cache) / "planner-local.json")


def _load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def measure(args: argparse.Namespace, names: list[str]) -> dict[str, Any]:
    load_before = _load()
    with tempfile.TemporaryDirectory(prefix="slipstream-planner-") as cache:
        hardware = _calibrate(args.world, cache)
    model = from_gpt_config(_gpt_config(args), seq=args.seq)
    cfg = BenchConfig(world=args.world, device="cpu", timeout_s=args.timeout)
    rows = []
    for name in names:
        case = CASES[name]
        layout = _layout(case, args)
        p = predict(model, hardware, layout)
        print(f"[planner_local] {name}", file=sys.stderr, flush=True)
        outcome = spawn_world(name, cfg, partial(_body, case, args))
        row: dict[str, Any] = {
            "name": name,
            "case": asdict(case),
            "predicted_bytes": p.memory.total,
            "predicted_s": p.step_time_s,
            "memory_breakdown": p.memory.to_dict(),
            "time_breakdown": p.time.to_dict(),
        }
        if outcome.ok:
            ranks = outcome.records
            row.update(
                measured_bytes=max(r["peak_bytes"] for r in ranks),
                rss_bytes=max(r["rss_bytes"] for r in ranks),
                measured_s=max(r["median_s"] for r in ranks),
                ranks=ranks,
            )
        else:
            row["error"] = outcome.error
            print(f"[planner_local] {name} failed: {outcome.error}\n{outcome.detail}",
                  file=sys.stderr)  # fmt: skip
        rows.append(row)
    return {
        "model": {"params": model.num_params(), **asdict(_gpt_config(args))},
        "args": vars(args),
        "hardware": hardware.to_dict(),
        "load_before": load_before,
        "load_after": _load(),
        "rows": rows,
    }


def _label(case: dict[str, Any], world: int) -> str:
    dp = world // (case["tp"] * case["pp"])
    parts = [f"TP{case['tp']}" if case["tp"] > 1 else "", f"PP{case['pp']}" if case["pp"] > 1
             else "", f"DP{dp}" if dp > 1 else ""]  # fmt: skip
    if case["pp"] > 1:
        parts.append("interleaved v2" if case["virtual_stages"] > 1 else "1F1B")
    parts.append(f"ZeRO-{case['zero_stage']}")
    if case["recompute"] != "none":
        parts.append(f"{case['recompute']} recompute")
    return " ".join(p for p in parts if p)


def format_table(result: dict[str, Any]) -> str:
    args, hw, m = result["args"], result["hardware"], result["model"]
    gemm = ", ".join(f"{r * 1e3:.1f}" for _, r in hw["gemm_tflops"])
    lines = [
        f"Reference GPT (h={m['hidden_size']}, {m['num_layers']} layers, {m['num_heads']} heads, "
        f"{m['num_kv_heads']} KV heads, vocab {m['vocab_size']}, {m['params'] / 1e6:.2f}M "
        f"parameters), seq {args['seq']}, micro-batch {args['micro']}, global batch "
        f"{args['global_batch']}, fp32 AdamW, world {args['world']} on this machine "
        f"({os.cpu_count()} cores). `local` profile from `slipstream plan --calibrate --nproc "
        f"{args['world']}` in the same run: GEMM {gemm} GFLOP/s per rank (256/512/1024), "
        f"copy {hw['memory_bandwidth_gbps']:.1f} GB/s, all-reduce "
        f"{hw['intra_node'][0][1]:.2f} GB/s per link + {hw['intra_node_latency_s'] * 1e3:.2f} "
        f"ms per step. Load average before {result['load_before']}, after "
        f"{result['load_after']}.",
        "",
        "| layout | memory predicted | memory measured | error | RSS growth | step predicted "
        "| step measured | error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        label = _label(row["case"], args["world"])
        pm, ps = row["predicted_bytes"] / _MB, row["predicted_s"]
        if "error" in row:
            lines.append(f"| {label} | {pm:.1f} MiB | failed: {row['error']} | | | {ps:.2f} s "
                         "| | |")  # fmt: skip
            continue
        mm, ms = row["measured_bytes"] / _MB, row["measured_s"]
        lines.append(
            f"| {label} | {pm:.1f} MiB | {mm:.1f} MiB | {100 * (pm / mm - 1):+.1f}% | "
            f"{row['rss_bytes'] / _MB:.0f} MiB | {ps:.2f} s | {ms:.2f} s | "
            f"{100 * (ps / ms - 1):+.1f}% |"
        )
    return "\n".join(lines)


def write_docs(table: str, path: Path = _DOCS) -> None:
    text = path.read_text()
    if _START not in text or _END not in text:
        raise SystemExit(f"{path} lacks the {_START} ... {_END} markers")
    head, rest = text.split(_START, 1)
    _, tail = rest.split(_END, 1)
    path.write_text(f"{head}{_START}\n{table}\n{_END}{tail}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=",".join(CASES), help="comma list of " + ",".join(CASES))
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--micro", type=int, default=2, help="sequences per micro-batch")
    parser.add_argument("--global-batch", type=int, default=16, help="sequences per step")
    parser.add_argument("--steps", type=int, default=3, help="timed steps")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps after profiling")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per layout")
    parser.add_argument("--json", default=None, help="write every number here")
    parser.add_argument("--write-docs", action="store_true", help="put the table in docs")
    args = parser.parse_args(argv)
    names = [n for n in args.cases.split(",") if n]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown cases {unknown}: choose from {', '.join(CASES)}")
    result = measure(args, names)
    table = format_table(result)
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.write_docs:
        write_docs(table)
    return result


if __name__ == "__main__":
    main()
