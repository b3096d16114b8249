"""Save at one world size and ZeRO stage, resume at another, export for Hugging Face.

    slipstream run --nproc 2 examples/checkpoint_reshard.py --stage 3 --dir /tmp/ckpt  # save
    slipstream run --nproc 1 examples/checkpoint_reshard.py --stage 1 --dir /tmp/ckpt  # resume
    slipstream convert /tmp/ckpt /tmp/ckpt-hf                                          # export

The first run trains 10 steps and saves; later runs load the newest checkpoint (whatever world
size and stage wrote it), check that the loaded weights give the saved loss, train 10 more
steps and save again.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

import slipstream
from slipstream.models import GPT, GPTConfig
from slipstream.utils import RepeatingLoader


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=0)  # passed by `slipstream run`
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--dir", default="ckpt")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()

    slipstream.init_distributed()
    world = dist.get_world_size()
    torch.manual_seed(0)
    with slipstream.zero.Init(enabled=args.stage == 3):
        model = GPT(GPTConfig.preset("tiny"))
    data = TensorDataset(
        torch.randint(0, 256, (512, 33), generator=torch.Generator().manual_seed(1))
    )
    config = {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 8 // world,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
        "zero_optimization": {"stage": args.stage},
        "checkpoint": {"keep_last": 2},
    }
    engine, _, loader, _ = slipstream.initialize(model=model, config=config, training_data=data)
    probe = data.tensors[0][:4]
    path, client = engine.load_checkpoint(args.dir)
    if path is not None:
        loss = engine(probe[:, :-1], probe[:, 1:]).item()
        if dist.get_rank() == 0:
            print(f"resumed {path} at step {engine.global_steps} on {world} rank(s), stage "
                  f"{args.stage}; probe loss {loss:.5f} (saved: {client['probe_loss']:.5f})")  # fmt: skip
    batches = RepeatingLoader(loader)  # epoch after epoch, however many runs resume
    for _ in range(args.steps):
        (batch,) = next(batches)
        engine.backward(engine(batch[:, :-1], batch[:, 1:]))
        engine.step()
    loss = engine(probe[:, :-1], probe[:, 1:]).item()
    engine.save_checkpoint(args.dir, client_state={"probe_loss": loss})
    if dist.get_rank() == 0:
        print(f"saved step {engine.global_steps} to {args.dir}; probe loss {loss:.5f}")
    engine.destroy()


if __name__ == "__main__":
    main()
