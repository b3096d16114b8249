"""ZeRO-3 end to end: build under zero.Init, train, read gathered weights, export 16-bit safetensors, generate.

Run on 2 local processes:

    slipstream run --nproc 2 examples/zero3_gpt.py --out /tmp/zero3-export
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import slipstream
from slipstream.models import GPT, GPTConfig


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=0)  # passed by `slipstream run`
    parser.add_argument("--out", default="zero3-export")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    slipstream.init_distributed()
    torch.manual_seed(0)
    # Sharded construction: when the context exits each rank holds only its shard of every
    # parameter (same values as eager construction); initialize() re-lays them for ZeRO-3.
    with slipstream.zero.Init():
        model = GPT(GPTConfig.preset("tiny"))
    world = dist.get_world_size()
    est = slipstream.zero.estimate_memory(model, world=world, stage=3)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine, optimizer, _, _ = slipstream.initialize(model=model, config=config)
    g = torch.Generator().manual_seed(dist.get_rank())
    data = torch.randint(0, 256, (4, 33), generator=g)
    for _ in range(args.steps):
        loss = engine(data[:, :-1], data[:, 1:])
        engine.backward(loss)
        engine.step()

    # Outside forward/backward each rank holds 1/N of the weights; gather to read them.
    with slipstream.zero.GatheredParameters(list(engine.module.parameters())):
        norm = torch.linalg.vector_norm(engine.module.embed_tokens.weight).item()
    engine.save_16bit_model(args.out)  # sharded safetensors + index, one unit at a time
    with engine.gathered_for_generation() as module:  # gather once, not once per token
        sample = module.generate(data[:1, :4], max_new_tokens=8, temperature=0.0)
    if dist.get_rank() == 0:
        print(f"estimated model-state bytes per rank: {est}")
        print(f"optimizer-state bytes held on rank 0: {optimizer.state_bytes()}")
        print(
            f"final loss {loss.item():.3f}; embedding norm {norm:.3f}; sample {sample[0].tolist()}"
        )
        print(f"exported to {args.out}")
    engine.destroy()


if __name__ == "__main__":
    main()
