"""The DeepSpeed getting-started tutorial: ``deepspeed.initialize(args=cmd_args, ...)``,
forward/backward/step through the engine, ``save_checkpoint`` with a client state and
``load_checkpoint`` to resume (the ``step`` comes back from the client state)."""

import argparse
import json
import os

import deepspeed
import torch
from torch import nn


def get_args():
    parser = argparse.ArgumentParser(description="My training script.")
    parser.add_argument(
        "--local_rank", type=int, default=-1, help="local rank passed from launcher"
    )
    parser.add_argument("--save_dir", type=str, required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--loss_file", type=str, default=None)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def batches(rank, n):
    g = torch.Generator().manual_seed(7 + rank)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)) for _ in range(n)]


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2))

    def forward(self, x, y):
        return nn.functional.mse_loss(self.net(x), y)


def train(cmd_args, start, stop, data, load):
    torch.manual_seed(0)
    model = Model()
    params = model.parameters()
    model_engine, _, _, _ = deepspeed.initialize(
        args=cmd_args, model=model, model_parameters=params
    )
    step = start
    if load:
        _, client_sd = model_engine.load_checkpoint(cmd_args.save_dir, "ckpt")
        step = client_sd["step"]
    losses = []
    for x, y in data[step:stop]:
        loss = model_engine(x, y)
        model_engine.backward(loss)
        model_engine.step()
        losses.append(loss.item())
        step += 1
    client_sd = {"step": step}
    model_engine.save_checkpoint(cmd_args.save_dir, "ckpt", client_state=client_sd)
    return losses


def main():
    cmd_args = get_args()
    deepspeed.init_distributed()
    data = batches(torch.distributed.get_rank(), cmd_args.steps)
    half = cmd_args.steps // 2
    # Train half, checkpoint, then a new engine resumes from the checkpoint.
    losses = train(cmd_args, 0, half, data, load=False)
    losses += train(cmd_args, half, cmd_args.steps, data, load=True)
    if cmd_args.loss_file and torch.distributed.get_rank() == 0:
        with open(cmd_args.loss_file, "w") as f:
            json.dump(losses, f)
    os.makedirs(cmd_args.save_dir, exist_ok=True)


if __name__ == "__main__":
    main()
