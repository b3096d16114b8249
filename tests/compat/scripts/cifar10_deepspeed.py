"""CIFAR-10 classifier in the style of DeepSpeedExamples' training/cifar/cifar10_deepspeed.py:
``--deepspeed --deepspeed_config ds_config.json``, ``training_data=`` to ``initialize``, the
engine's data loader. A tiny stand-in for CIFAR-10 (random 3x8x8 images) is made in code."""

import argparse
import json

import deepspeed
import torch
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator


def add_argument():
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("-e", "--epochs", default=2, type=int, help="number of total epochs")
    parser.add_argument(
        "--local_rank", type=int, default=-1, help="local rank passed from launcher"
    )
    parser.add_argument("--loss_file", type=str, default=None, help="write the losses here")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 8, 1)
        self.fc1 = nn.Linear(8 * 3 * 3, 24)
        self.fc2 = nn.Linear(24, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = F.relu(self.conv2(x))
        x = torch.flatten(x, 1)
        return self.fc2(F.relu(self.fc1(x)))


def stand_in_cifar(n=64):
    g = torch.Generator().manual_seed(1234)
    images = torch.randn(n, 3, 8, 8, generator=g)
    labels = torch.randint(0, 10, (n,), generator=g)
    return torch.utils.data.TensorDataset(images, labels)


def main():
    args = add_argument()
    deepspeed.init_distributed()
    torch.manual_seed(42)
    trainset = stand_in_cifar()
    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    model_engine, _, trainloader, __ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=trainset
    )
    local_device = get_accelerator().device_name(model_engine.local_rank)
    if local_device != "cpu":
        local_device = f"{local_device}:{model_engine.local_rank}"
    criterion = nn.CrossEntropyLoss()
    losses = []
    for epoch in range(args.epochs):
        for i, data in enumerate(trainloader):
            inputs, labels = data[0].to(local_device), data[1].to(local_device)
            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)
            model_engine.backward(loss)
            model_engine.step()
            losses.append(loss.item())
            if model_engine.global_rank == 0:
                print(f"[{epoch + 1}, {i + 1:5d}] loss: {loss.item():.6f}")
    if args.loss_file and model_engine.global_rank == 0:
        with open(args.loss_file, "w") as f:
            json.dump(losses, f)


if __name__ == "__main__":
    main()
