"""ZeRO++ vs ZeRO-3: bytes per training step, split into intra-node and cross-node.

Runs the reference GPT on ``--world`` gloo ranks declared as nodes of ``--ranks-per-node``
(``SLIPSTREAM_RANKS_PER_NODE``; ranks are node-major) with ZeRO-3 and with each ZeRO++
technique alone and together, on the same data, and prints per step (the last one):

* cross-node bytes per node boundary (the comm logger's model: rings for all-gather and
  reduce-scatter, exact addressing for all-to-all; see ``comm._cross_node_bytes``) and the
  ratio to ZeRO-3 (paper: 0.25x for all three);
* bytes per collective and axis (``dp`` = all ranks, ``intra_node``, ``inter_node``);
* median step time (CPU, noisy; on one machine "nodes" share memory, so times do not show the
  bandwidth saving) and the loss after ``--steps`` steps; hpZ's secondary-copy memory.

    python benchmarks/zeropp.py                      # world 4 = 2 nodes x 2, GPT small, bf16
    python benchmarks/zeropp.py --world 8 --ranks-per-node 4 --preset tiny --steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

VARIANTS: dict[str, dict[str, Any]] = {
    "ZeRO-3": {},
    "qwZ": {"zero_quantized_weights": True},
    "hpZ": {"zero_hpz_partition_size": -1},  # -1: ranks per node
    "qgZ": {"zero_quantized_gradients": True},
    "ZeRO++ (all three)": {
        "zero_quantized_weights": True,
        "zero_hpz_partition_size": -1,
        "zero_quantized_gradients": True,
    },
}


def _run(rank: int, args: argparse.Namespace, port: int, out: str) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(args.world), LOCAL_RANK=str(rank % args.ranks_per_node),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        SLIPSTREAM_RANKS_PER_NODE=str(args.ranks_per_node),
    )  # fmt: skip
    torch.set_num_threads(1)
    import slipstream
    from slipstream.distributed import comm
    from slipstream.models import GPT, GPTConfig

    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    results = {}
    for name, extra in VARIANTS.items():
        zero = {"stage": 3, "stage3_param_persistence_threshold": 0}
        zero.update({k: (args.ranks_per_node if v == -1 else v) for k, v in extra.items()})
        torch.manual_seed(0)
        model = GPT(GPTConfig.preset(args.preset))
        config = {
            "train_micro_batch_size_per_gpu": args.batch,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": zero,
            "bf16": {"enabled": args.bf16},
        }
        engine, opt, _, _ = slipstream.initialize(model=model, config=config)
        g = torch.Generator().manual_seed(rank)
        times, loss = [], torch.zeros(())
        for _ in range(args.steps):
            x = torch.randint(0, 256, (args.batch, args.seq + 1), generator=g)
            comm.comm_counters.reset()
            dist.barrier()
            t0 = time.perf_counter()
            loss = engine(x[:, :-1], x[:, 1:])
            engine.backward(loss)
            engine.step()
            times.append(time.perf_counter() - t0)
        per_op = {
            f"{axis}/{op}": [e.bytes, e.cross_node_bytes]
            for (axis, op), e in comm.comm_counters.stats.items()
        }
        results[name] = {
            "per_op": per_op,
            "cross": comm.comm_counters.cross_node_bytes(),
            "time": statistics.median(times),
            "loss": loss.item(),
            "secondary": opt.store.secondary_bytes(),
            "params": sum(p.numel() for p in model.parameters()),
        }
        engine.destroy()
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--preset", default="small", help="GPTConfig preset (tiny, small, 25m)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--fp32", dest="bf16", action="store_false", help="train in fp32 (default bf16)")
    p.add_argument("--json", default=None, help="write every rank's figures here")
    args = p.parse_args()
    if args.world % args.ranks_per_node:
        p.error("--ranks-per-node must divide --world")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_run, args=(args, port, out), nprocs=args.world, start_method="spawn")
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(args.world)]
    nodes = args.world // args.ranks_per_node
    base = sum(r["ZeRO-3"]["cross"] for r in ranks) / nodes
    first = ranks[0]
    print(
        f"GPT {args.preset} ({first['ZeRO-3']['params'] / 1e6:.1f}M params), world {args.world} = "
        f"{nodes} nodes x {args.ranks_per_node}, {'bf16' if args.bf16 else 'fp32'}, "
        f"batch {args.batch}x{args.seq} per rank; bytes of the last of {args.steps} steps\n"
    )
    print(
        "| variant | cross-node MB / node | vs ZeRO-3 | step s (median) | loss | hpZ copy MB/rank |"
    )
    print("|---|---|---|---|---|---|")
    for name in VARIANTS:
        cross = sum(r[name]["cross"] for r in ranks) / nodes
        step = max(r[name]["time"] for r in ranks)
        print(
            f"| {name} | {cross / 2**20:.2f} | {cross / base:.3f}x | {step:.3f} | "
            f"{first[name]['loss']:.4f} | {first[name]['secondary'] / 2**20:.2f} |"
        )
    print("\nper collective (rank 0): MB sent / cross-node MB share")
    for name in VARIANTS:
        ops = ", ".join(
            f"{op} {b / 2**20:.2f}/{c / 2**20:.2f}"
            for op, (b, c) in sorted(first[name]["per_op"].items())
        )
        print(f"  {name}: {ops}")
    if args.json:
        Path(args.json).write_text(json.dumps(ranks, indent=1))


if __name__ == "__main__":
    main()
