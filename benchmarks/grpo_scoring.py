"""GRPO scoring at several ranks: length-grouped, shared-prompt scoring vs the padded forward.

Usage::

    python benchmarks/grpo_scoring.py                       # 2 ranks, ZeRO-3, ragged answers
    python benchmarks/grpo_scoring.py --eos-weight 0 --steps 6

World ``--world`` (gloo), ZeRO stage ``--stage``, the tiny LLaMA of ``benchmarks/rlhf.py``
(``build_model``, ragged answers with ``--eos-weight`` > 0), each rank its own prompts. Two
engines on the same starting weights, two trainers: ``ragged`` (``GRPOTrainer`` as shipped:
each distinct prompt run once, answers in length-sorted groups, the ranks agreeing on the
number of forwards) and ``padded`` (the trainer's single padded forward). Their steps
alternate (the order reversed every other step); each step draws the same answers in both
(same seed, same step, same rank), and the weights drift apart only by rounding.

Per step: the slowest rank's wall time, and each rank's process CPU time of the whole step
and of its scoring forwards (``GRPOMetrics.score_s``: the reference and old-policy passes;
the policy's own forwards are inside ``train_s``). Medians over ``--steps`` after
``--warmup``. The machine this was written on is a shared 2-core VM: compare the ratio.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._harness import BenchConfig, spawn_world
from benchmarks.rlhf import Options, build_model, keyword_reward, random_prompts


def _rank(opts: Options, stage: int, updates: int, rank: int, device: torch.device) -> dict:
    import slipstream
    from slipstream.rlhf import GRPOConfig, GRPOTrainer

    model = build_model(opts, ragged=True)
    reference = copy.deepcopy(model)
    config = {
        "train_micro_batch_size_per_gpu": opts.prompts * opts.group,
        "optimizer": {"type": "AdamW", "params": {"lr": opts.lr, "weight_decay": 0.0}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "hybrid_engine": {"enabled": True, "max_out_tokens": opts.max_len},
    }
    cfg = GRPOConfig(
        group_size=opts.group, max_new_tokens=opts.grpo_new_tokens, kl_coef=opts.kl_coef,
        top_k=0, updates_per_batch=updates,
    )  # fmt: skip
    trainers = {}
    for name in ("ragged", "padded"):
        engine, *_ = slipstream.initialize(model=copy.deepcopy(model), config=config)
        trainers[name] = GRPOTrainer(engine, keyword_reward, cfg, reference=reference)
    trainers["padded"]._ragged = lambda: False  # type: ignore[method-assign]
    ids = random_prompts(opts, opts.prompts, seed=3000 + rank)
    out: dict[str, list[dict[str, float]]] = {name: [] for name in trainers}
    names = list(trainers)
    for step in range(opts.warmup + opts.steps):
        for name in names if step % 2 == 0 else names[::-1]:
            torch.distributed.barrier()
            start, cpu = time.perf_counter(), time.process_time()
            m = trainers[name].step(ids, torch.ones_like(ids))
            wall = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            record = {"cpu_s": time.process_time() - cpu, "score_s": m.score_s}
            torch.distributed.all_reduce(wall, op=torch.distributed.ReduceOp.MAX)
            record |= {"wall_s": float(wall), "length": m.response_length, "kl": m.kl}
            if step >= opts.warmup:
                out[name].append(record)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--updates", type=int, default=1, help="updates_per_batch")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--eos-weight", type=float, default=0.8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=1)
    ns = parser.parse_args(argv)
    opts = Options(
        world=ns.world, prompts=ns.prompts, group=ns.group, grpo_new_tokens=ns.new_tokens,
        eos_weight=ns.eos_weight, steps=ns.steps, warmup=ns.warmup,
    )  # fmt: skip
    cfg = BenchConfig(world=ns.world, timeout_s=opts.timeout_s, seed=opts.seed)
    outcome = spawn_world("grpo-scoring", cfg, partial(_rank, opts, ns.stage, ns.updates))
    if not outcome.ok:
        raise SystemExit(f"world failed: {outcome.error}\n{outcome.detail}")
    print(
        f"world {ns.world}, ZeRO-{ns.stage}, {ns.prompts} prompts x {ns.group} answers per rank, "
        f"up to {ns.new_tokens} tokens, updates_per_batch {ns.updates}; medians of {ns.steps} "
        "steps"
    )
    print(f"{'variant':<8} {'wall s':>8} {'cpu s r0':>9} {'cpu s r1':>9} {'score s':>8} {'len':>6}")
    med = statistics.median
    for name in ("ragged", "padded"):
        ranks = [r[name] for r in outcome.records]
        cpus = " ".join(f"{med(x['cpu_s'] for x in r):>9.3f}" for r in ranks[:2])
        print(
            f"{name:<8} {med(x['wall_s'] for x in ranks[0]):>8.3f} {cpus} "
            f"{med(x['score_s'] for x in ranks[0]):>8.3f} "
            f"{statistics.mean(x['length'] for r in ranks for x in r):>6.1f}"
        )
    ragged, padded = (
        [x["wall_s"] for x in outcome.records[0][name]] for name in ("ragged", "padded")
    )
    cpu_ratio = [
        med(a["cpu_s"] / b["cpu_s"] for a, b in zip(r["ragged"], r["padded"]))
        for r in outcome.records
    ]
    print(
        f"median per-step wall ratio ragged/padded: {med(a / b for a, b in zip(ragged, padded)):.2f};"
        f" process CPU ratio per rank: {' '.join(f'{c:.2f}' for c in cpu_ratio)}"
    )


if __name__ == "__main__":
    main()
