"""A DeepSpeed-style training script for the ``slipstream tune`` tests: trains the tiny
reference GPT on random tokens with ``--deepspeed_config PATH`` (and ``--local_rank``).

``--fail-rank R`` raises on rank R after the first step (a failing candidate).
"""

from __future__ import annotations

import argparse

import torch

import slipstream
from slipstream.distributed.mesh import dp_group
from slipstream.models.gpt import GPT, GPTConfig


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed_config", required=True)
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--fail-rank", type=int, default=-1)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = GPTConfig.preset("tiny", max_seq_len=args.seq)
    engine, *_ = slipstream.initialize(model=GPT(config), config=args.deepspeed_config)
    micro = engine.train_micro_batch_size_per_gpu()
    # Tensor-parallel ranks must see the same batch: seed by the data-parallel rank.
    gen = torch.Generator().manual_seed(torch.distributed.get_rank(dp_group(engine.mesh)))
    for step in range(args.steps):
        for _ in range(engine.gradient_accumulation_steps()):
            tokens = torch.randint(0, config.vocab_size, (micro, args.seq + 1), generator=gen)
            loss = engine(tokens[:, :-1], tokens[:, 1:])
            engine.backward(loss)
            engine.step()
        if step == 0 and torch.distributed.get_rank() == args.fail_rank:
            raise RuntimeError(f"rank {args.fail_rank} fails on purpose (--fail-rank)")


if __name__ == "__main__":
    main()
