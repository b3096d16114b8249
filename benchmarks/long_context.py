"""Long context: the longest sequence a Hugging Face LLaMA-shaped model trains (one step)
under a per-rank memory cap, with each memory technique switched on in turn, slipstream and
DeepSpeed 0.19.8's Arctic Long Sequence Training (ALST) pieces side by side.

Rows (cumulative, as ALST's paper stacks them): plain HF; + activation checkpointing (HF's
``gradient_checkpointing_enable``); + tiled MLP and tiled logits+loss; + offload of the
checkpointed inputs (``cpu_checkpointing``); then the same at P = 2 with Ulysses, and ring
attention (``sequence_parallel_mode: "ring"``) at P = 2 with and without the tiling. DeepSpeed's
rows run its own pieces on the same model: ``UlyssesSPAttentionHF.register_with_transformers``,
its ``TiledMLP`` patched into ``LlamaMLP.forward`` and its ``TiledFusedLogitsLoss`` in the
loss (as ALST's tutorial shows), its engine (ZeRO stage 0, as slipstream's rows), and its
checkpoint-offload context manager (``get_checkpoint_hidden_states_offloading_ctx_manager``).

Memory (per rank, the maximum over ranks): the peak resident set size during one training
step (forward, backward, optimizer step) above the RSS right before it, read as Linux's
``VmHWM`` after resetting it (``/proc/self/clear_refs``), on CUDA ``max_memory_allocated``
above the allocation before the step. A warm-up step at the smallest length first creates
gradients and optimizer state, so the figure is the activations' and the step's transients.
``MALLOC_MMAP_THRESHOLD_`` is fixed at 64 KiB in the ranks so freed tensors go back to the
OS and the resident set follows the live tensors. The search: lengths double from
``--start`` until a step exceeds the cap, then ``--bisect`` bisection steps between the last
length that fits and the first that does not (lengths stay multiples of 2 x P x 8).

    python benchmarks/long_context.py --quick             # smoke test: tiny cap, few probes
    python benchmarks/long_context.py --cap-mib 16 --json long_context.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks._harness import BenchConfig, PeakMemory, spawn_world

MiB = 2**20


# Each row: framework, P, and its switches (cumulative).
ROWS: list[tuple[str, str, int, dict[str, bool]]] = [
    ("plain HF", "slipstream", 1, {}),
    ("+ checkpointing", "slipstream", 1, {"ckpt": True}),
    ("+ tiled MLP/loss", "slipstream", 1, {"ckpt": True, "tiled": True}),
    ("+ offload", "slipstream", 1, {"ckpt": True, "tiled": True, "offload": True}),
    ("+ Ulysses P=2", "slipstream", 2, {"ckpt": True}),
    ("+ Ulysses + tiled", "slipstream", 2, {"ckpt": True, "tiled": True}),
    (
        "+ Ulysses + tiled + offload",
        "slipstream",
        2,
        {"ckpt": True, "tiled": True, "offload": True},
    ),
    ("plain HF", "deepspeed", 1, {}),
    ("ALST: ckpt + tiled", "deepspeed", 1, {"ckpt": True, "tiled": True}),
    ("ALST: + offload", "deepspeed", 1, {"ckpt": True, "tiled": True, "offload": True}),
    ("ALST: Ulysses + ckpt + tiled", "deepspeed", 2, {"ckpt": True, "tiled": True}),
    ("ALST: + offload", "deepspeed", 2, {"ckpt": True, "tiled": True, "offload": True}),
    # Appended so the rows above keep their indices (--rows); DeepSpeed 0.19.8 has no ring.
    ("+ ring P=2", "slipstream", 2, {"ckpt": True, "ring": True}),
    ("+ ring + tiled", "slipstream", 2, {"ckpt": True, "tiled": True, "ring": True}),
]


def _model(args: argparse.Namespace) -> Any:
    """A LLaMA-shaped model: LLaMA-3-8B's ratios (vocab / hidden = 32, intermediate /
    hidden = 3.5, GQA 2:1) at a size this CPU trains."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    h = args.hidden
    config = LlamaConfig(
        vocab_size=32 * h,
        hidden_size=h,
        intermediate_size=7 * h // 2,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1 << 20,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


def _batch(seq: int, vocab: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(seq))
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(seq)[None]}


# ------------------------------------------------------------------------------ slipstream
def _slipstream_trainer(args: argparse.Namespace, p: int, sw: dict[str, bool]) -> Any:
    import slipstream
    from slipstream.distributed import comm
    from slipstream.sequence import shard_causal_lm_batch, shard_causal_lm_batch_ring

    model = _model(args)
    if sw.get("ckpt"):
        model.gradient_checkpointing_enable()
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 0},
        "sequence_parallel_size": p,
        "gradient_clipping": 0.0,
    }
    if sw.get("ring"):
        config["sequence_parallel_mode"] = "ring"
    shard = shard_causal_lm_batch_ring if sw.get("ring") else shard_causal_lm_batch
    if sw.get("tiled"):
        config["tiled_compute"] = {"mlp": True, "logits_loss": True}
    if sw.get("offload"):
        config["activation_checkpointing"] = {"cpu_checkpointing": True}
    engine, *_ = slipstream.initialize(model=model, config=config)
    vocab = model.config.vocab_size

    def step(seq: int) -> float:
        batch = _batch(seq, vocab)
        if p > 1:
            batch = shard(batch, p, comm.get_rank())
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        return float(loss.detach())

    return step


# ------------------------------------------------------------------------------- DeepSpeed
def _deepspeed_trainer(args: argparse.Namespace, p: int, sw: dict[str, bool]) -> Any:
    import math

    import torch.distributed as dist
    import torch.distributed.nn.functional as dist_fn

    from tests.compat._deepspeed import import_deepspeed

    deepspeed = import_deepspeed()
    from deepspeed.runtime.sequence_parallel import ulysses_sp

    mpu = None
    if p > 1:
        deepspeed.init_distributed(dist_backend="gloo")  # its comm over the harness's group
        mpu = ulysses_sp.UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=_model(args),
            core_attn_implementation="sdpa",
            sequence_parallel_size=p,
            micro_batch_size=1,
            seq_length_is_variable=True,
        )
    if sw.get("tiled"):
        from transformers.models.llama import modeling_llama

        def tiled_mlp_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
            shards = max(1, math.ceil(x.shape[1] / x.shape[2]))

            def mlp(self: Any, x: torch.Tensor) -> torch.Tensor:
                return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

            params = [self.down_proj.weight, self.gate_proj.weight, self.up_proj.weight]
            return ulysses_sp.TiledMLP.apply(mlp, self, x, shards, params)  # type: ignore[no-any-return]

        modeling_llama.LlamaMLP.forward = tiled_mlp_forward
    model = _model(args)
    if sw.get("ckpt"):
        model.gradient_checkpointing_enable()
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {"stage": 0},
        "sequence_parallel_size": p,
        "gradient_clipping": 0.0,
    }
    engine, *_ = deepspeed.initialize(model=model, config=config, mpu=mpu)
    vocab = model.config.vocab_size
    offload = None
    if sw.get("offload"):
        from deepspeed.runtime.activation_checkpointing.offload_activations import (
            get_checkpoint_hidden_states_offloading_ctx_manager,
        )

        offload = get_checkpoint_hidden_states_offloading_ctx_manager()
    group = mpu.get_sequence_parallel_group() if mpu is not None else None

    def loss_of(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        shift = batch.pop("shift_labels")
        if not sw.get("tiled"):
            out = engine(**batch)
            logits = out.logits.float()
            return torch.nn.functional.cross_entropy(
                logits.view(-1, logits.shape[-1]), shift.view(-1), ignore_index=-100
            )
        hidden = engine.module.model(**batch).last_hidden_state
        head = engine.module.lm_head

        def fn(self: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(
                self(x).float(), y, ignore_index=-100, reduction="sum"
            )

        shards = max(1, min(math.ceil(vocab / args.hidden), math.ceil(shift.numel() / 64)))
        total = ulysses_sp.TiledFusedLogitsLoss.apply(
            fn, head, hidden, shift, None, shards, [head.weight], "sum"
        )
        return total / (shift != -100).sum().clamp(min=1)

    def step(seq: int) -> float:
        batch = _batch(seq, vocab)
        labels = batch.pop("labels")
        batch["shift_labels"] = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
        if p > 1:
            rank, chunk = dist.get_rank(group), seq // p
            batch = {k: v[:, rank * chunk : (rank + 1) * chunk] for k, v in batch.items()}
        context = offload if offload is not None else _Null()
        with context:
            loss = loss_of(dict(batch))
            if p > 1:  # ALST's weighted mean over the shards (differentiable all-gather)
                good = (batch["shift_labels"] != -100).sum()
                losses = dist_fn.all_gather(loss, group=group)
                goods = dist_fn.all_gather(good, group=group)
                loss = sum(part * g for part, g in zip(losses, goods)) / sum(goods)
            engine.backward(loss)
        engine.step()
        return float(loss.detach())

    return step


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


# ---------------------------------------------------------------------------------- search
def _probe(step: Any, seq: int, memory: PeakMemory) -> int:
    """Peak bytes above the pre-step level of one training step at ``seq``, max over ranks."""
    import torch.distributed as dist

    before = PeakMemory._rss() if memory.device.type == "cpu" else 0
    memory.reset_peak()
    step(seq)
    peak = torch.tensor(memory.peak_bytes() - before, dtype=torch.int64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return int(peak)


def _search(step: Any, args: argparse.Namespace, p: int, memory: PeakMemory) -> dict[str, Any]:
    """Double from ``start`` until the cap is exceeded, then bisect."""
    unit = 16 * p
    cap = int(args.cap_mib * MiB)
    probes: list[tuple[int, int, float]] = []

    def fits(seq: int) -> bool:
        t = time.perf_counter()
        peak = _probe(step, seq, memory)
        probes.append((seq, peak, time.perf_counter() - t))
        return peak <= cap

    step(unit)  # warm-up: gradients and optimizer state exist before any measurement
    good, bad, seq = 0, 0, max(unit, args.start // unit * unit)
    while seq <= args.max_seq:
        if not fits(seq):
            bad = seq
            break
        good, seq = seq, seq * 2
    for _ in range(args.bisect if bad else 0):
        mid = (good + bad) // 2 // unit * unit
        if mid <= good or mid >= bad:
            break
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return {"longest": good, "exceeds": bad or None, "probes": probes}


def _rank(args: argparse.Namespace, row: int, rank: int, device: torch.device) -> dict[str, Any]:
    _, framework, p, switches = ROWS[row]
    memory = PeakMemory(device)
    build = _slipstream_trainer if framework == "slipstream" else _deepspeed_trainer
    try:
        step = build(args, p, switches)
        result = _search(step, args, p, memory)
    except Exception as exc:  # a piece that cannot run here: say which and why
        first = (str(exc).splitlines() or [""])[0][:300]
        return {"error": f"{type(exc).__name__}: {first}"}
    return {**result, "method": memory.method}


def _table(results: list[dict[str, Any]], cap: float) -> str:
    plain = next((r["longest"] for r in results if r.get("row") == 0 and r.get("longest")), None)
    ds = {
        (ROWS[r["row"]][2], tuple(sorted(ROWS[r["row"]][3].items()))): r.get("longest")
        for r in results
        if ROWS[r["row"]][1] == "deepspeed"
    }
    lines = [
        f"longest sequence trained in one step under {cap:g} MiB per rank (step peak RSS above "
        "the pre-step level)",
        f"{'framework':<11} {'P':>2} {'technique':<30} {'longest':>8} {'vs plain':>9} "
        f"{'vs DeepSpeed':>13}",
    ]
    for r in results:
        name, framework, p, sw = ROWS[r["row"]]
        if "error" in r:
            lines.append(f"{framework:<11} {p:>2} {name:<30} cannot run: {r['error']}")
            continue
        longest = r["longest"]
        vs_plain = f"{longest / plain:.2f}x" if plain and longest else "-"
        peer = ds.get((p, tuple(sorted(sw.items()))))
        vs_ds = f"{longest / peer:.2f}x" if framework == "slipstream" and peer and longest else "-"
        lines.append(f"{framework:<11} {p:>2} {name:<30} {longest:>8} {vs_plain:>9} {vs_ds:>13}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--cap-mib", type=float, default=16.0)
    ap.add_argument("--start", type=int, default=256)
    ap.add_argument("--max-seq", type=int, default=1 << 16)
    ap.add_argument("--bisect", type=int, default=2)
    ap.add_argument("--rows", default="all", help="comma-separated row indices, or 'all'")
    ap.add_argument("--quick", action="store_true", help="smoke test: 2 MiB cap, 1 bisection")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.hidden, args.layers, args.cap_mib, args.start, args.bisect = 16, 2, 2.0, 64, 1
        args.max_seq = 1024
    rows = range(len(ROWS)) if args.rows == "all" else [int(i) for i in args.rows.split(",")]
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    results = []
    for row in rows:
        p = ROWS[row][2]
        cfg = BenchConfig(world=p, timeout_s=1800.0)
        start = time.perf_counter()
        outcome = spawn_world(f"long-context-{row}", cfg, partial(_rank, args, row))
        record = outcome.records[0] if outcome.ok else {"error": outcome.error}
        record = {"row": row, "seconds": round(time.perf_counter() - start, 1), **record}
        results.append(record)
        name, framework, _, _ = ROWS[row]
        print(f"[{framework} P={p} {name}] {json.dumps(record)}", flush=True)
    print(_table(results, args.cap_mib))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"machine: {os.cpu_count()} cores, load average {load:.1f}; model hidden={args.hidden}, "
          f"layers={args.layers}, vocab={32 * args.hidden}, fp32, batch 1")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
