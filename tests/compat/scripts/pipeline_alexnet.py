"""Pipeline-parallel AlexNet in the style of DeepSpeedExamples'
training/pipeline_parallelism/train.py: the torchvision AlexNet's layers joined into a
``PipelineModule`` (``partition_method="parameters"``), ``training_data=`` to ``initialize``
and ``engine.train_batch()`` with no iterator. The network keeps AlexNet's layer sequence,
narrowed for 16x16 stand-in images (made in code), so stage 1 starts with
``ReLU(inplace=True)`` as in the example."""

import argparse
import json
import os

import deepspeed
import torch
import torch.nn as nn
from deepspeed.pipe import PipelineModule


class AlexNet(nn.Module):
    def __init__(self, num_classes=10, dropout=0.5):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, kernel_size=3, stride=1, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=2, stride=2),
            nn.Conv2d(8, 16, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=2, stride=2),
        )
        self.avgpool = nn.AdaptiveAvgPool2d((4, 4))
        self.classifier = nn.Sequential(
            nn.Dropout(p=dropout),
            nn.Linear(16 * 4 * 4, 128),
            nn.ReLU(inplace=True),
            nn.Dropout(p=dropout),
            nn.Linear(128, 32),
            nn.ReLU(inplace=True),
            nn.Linear(32, num_classes),
        )


def cifar_trainset(n=64):
    g = torch.Generator().manual_seed(2024)
    return torch.utils.data.TensorDataset(
        torch.randn(n, 3, 16, 16, generator=g), torch.randint(0, 10, (n,), generator=g)
    )


def get_args():
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("-s", "--steps", type=int, default=3, help="quit after this many steps")
    parser.add_argument("-p", "--pipeline-parallel-size", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1138, help="PRNG seed")
    parser.add_argument("--dropout", type=float, default=0.5)
    parser.add_argument("--loss_file", type=str, default=None)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def join_layers(vision_model):
    return [
        *vision_model.features,
        vision_model.avgpool,
        lambda x: torch.flatten(x, 1),
        *vision_model.classifier,
    ]


def train_pipe(args, part="parameters"):
    torch.manual_seed(args.seed)
    deepspeed.runtime.utils.set_random_seed(args.seed)
    net = AlexNet(num_classes=10, dropout=args.dropout)
    net = PipelineModule(
        layers=join_layers(net),
        loss_fn=torch.nn.CrossEntropyLoss(),
        num_stages=args.pipeline_parallel_size,
        partition_method=part,
        activation_checkpoint_interval=0,
    )
    trainset = cifar_trainset()
    engine, _, _, _ = deepspeed.initialize(
        args=args,
        model=net,
        model_parameters=[p for p in net.parameters() if p.requires_grad],
        training_data=trainset,
    )
    return [engine.train_batch().item() for _ in range(args.steps)]


if __name__ == "__main__":
    args = get_args()
    deepspeed.init_distributed()
    args.local_rank = int(os.environ["LOCAL_RANK"])
    losses = train_pipe(args)
    if args.loss_file and torch.distributed.get_rank() == 0:
        with open(args.loss_file, "w") as f:
            json.dump(losses, f)
