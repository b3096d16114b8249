"""Long context with sequence parallelism: a sequence that does not fit one process's memory
budget trains when its tokens are split over the ranks (Ulysses or LSS attention).

Run on 2 local processes (each holds half of every sequence):

    slipstream run --nproc 2 examples/long_context.py --seq 2048 --budget-mib 128

Every rank first measures the exact peak tensor memory of one training step (forward and
backward, parameters excluded; ``TensorMemoryTracker``) twice: for the whole sequence on this
process alone (no sequence parallelism), and for its segment with the sequence sharded over
all ranks. It prints both against ``--budget-mib``. Then it trains ``--steps`` steps through
``slipstream.initialize`` with ``sequence_parallel_size`` = world size and ZeRO-3 (the loader
gives the ranks of a sequence-parallel group the same sequences, each keeping its slice).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import slipstream
from slipstream.models import GPT, GPTConfig
from slipstream.science._memory import TensorMemoryTracker
from slipstream.sequence import parallelize_sequence_


class Tokens(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Random byte sequences of ``seq + 1`` tokens (inputs, next-token labels)."""

    def __init__(self, n: int, seq: int) -> None:
        self.data = torch.randint(0, 256, (n, seq + 1), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i, :-1], self.data[i, 1:]


def build(args: argparse.Namespace) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig.preset(
        "small", num_layers=args.layers, max_seq_len=args.seq, sequence_parallel=args.attention
    )
    return GPT(cfg)


def step_peak(model: GPT, x: torch.Tensor, y: torch.Tensor) -> int:
    """Peak bytes of tensors allocated during one forward + backward."""
    with TensorMemoryTracker() as mem:
        model(x, y).backward()
    model.zero_grad(set_to_none=True)
    return mem.peak_bytes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=0)  # passed by `slipstream run`
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--attention", choices=("ulysses", "lss"), default="ulysses")
    parser.add_argument("--budget-mib", type=float, default=128.0)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    slipstream.init_distributed()
    world, rank = dist.get_world_size(), dist.get_rank()
    x, y = Tokens(1, args.seq)[0]
    x, y = x[None], y[None]
    seg = args.seq // world

    # Without sequence parallelism: the whole sequence on this process (no group bound).
    alone = step_peak(build(args), x, y)
    # With it: this rank's segment; attention exchanges the rest over the world.
    model = parallelize_sequence_(build(args), dist.group.WORLD)
    sharded = step_peak(
        model, x[:, rank * seg : (rank + 1) * seg], y[:, rank * seg : (rank + 1) * seg]
    )
    peak = torch.tensor([sharded], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    budget = args.budget_mib * 2**20
    if rank == 0:
        verdict = {True: "fits", False: "does NOT fit"}
        print(
            f"seq_len={args.seq}, GPT small x {args.layers} layers, budget {args.budget_mib:.0f} "
            f"MiB per process\n"
            f"  1 process, whole sequence:   peak {alone / 2**20:7.1f} MiB  "
            f"-> {verdict[alone <= budget]}\n"
            f"  {world} processes, {args.attention}: peak {peak.item() / 2**20:7.1f} MiB per rank "
            f"-> {verdict[peak.item() <= budget]}",
            flush=True,
        )

    config = {
        "train_batch_size": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
        "zero_optimization": {"stage": 3},
        "sequence_parallel_size": world,
    }
    engine, _, loader, _ = slipstream.initialize(
        model=build(args), config=config, training_data=Tokens(2 * args.steps, args.seq)
    )
    for step, (xs, ys) in enumerate(loader):
        loss = engine(xs, ys)  # xs: [2, seq / world], this rank's slice
        engine.backward(loss)
        engine.step()
        if rank == 0:
            print(f"step {step + 1}: loss {loss.item():.4f} (tokens per rank {xs.numel()})")
    engine.destroy()


if __name__ == "__main__":
    main()
