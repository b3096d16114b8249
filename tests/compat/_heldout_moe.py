"""Run DeepSpeedExamples' ``training/cifar/cifar10_deepspeed.py`` (read from a checkout, not
kept in this repository) unchanged with its ``--moe`` flags inside a gloo rank, under
slipstream (``SLIPSTREAM_AS_DEEPSPEED=1``) or the installed DeepSpeed.

This machine has neither torchvision nor the network to download CIFAR-10, so the rank gets
a stand-in ``torchvision`` module: ``datasets.CIFAR10`` is a fixed synthetic set of 3x32x32
images (seeded, the same in every run) and ``transforms`` has the three transforms the
script uses. The script's file is executed as it is; the rank seeds torch first (the script
sets no seed) and records every value ``nn.CrossEntropyLoss`` returns, at full precision.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import torch
from torch import nn

SCRIPT = "training/cifar/cifar10_deepspeed.py"
DEFAULT_CHECKOUT = "/work/.mirror/deepspeedai+DeepSpeedExamples/repo"
TRAIN_SAMPLES, TEST_SAMPLES = 160, 40  # 10 steps of DeepSpeed's batch of 16; 4 per class

# training/cifar/run_ds_moe.sh, in fp32 and for one epoch, logging every step
ARGS = [
    "--deepspeed",
    "--moe",
    "--ep-world-size", "2",
    "--num-experts", "2",
    "--top-k", "1",
    "--noisy-gate-policy", "RSample",
    "--moe-param-group",
    "--dtype", "fp32",
    "--epochs", "1",
    "--log-interval", "1",
]  # fmt: skip


def script_source(checkout: str | None = None) -> str | None:
    """The script's text from ``DEEPSPEED_EXAMPLES`` (a work tree or a bare git directory),
    or None without a checkout."""
    root = Path(checkout or os.environ.get("DEEPSPEED_EXAMPLES", DEFAULT_CHECKOUT))
    if (root / SCRIPT).is_file():
        return (root / SCRIPT).read_text()
    if (root / "HEAD").is_file() and (root / "objects").is_dir():
        proc = subprocess.run(
            ["git", f"--git-dir={root}", "show", f"HEAD:{SCRIPT}"], capture_output=True, text=True
        )
        return proc.stdout if proc.returncode == 0 else None
    return None


class _SyntheticCIFAR10(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """``torchvision.datasets.CIFAR10``'s constructor and items, on fixed random images."""

    def __init__(self, root: str, train: bool = True, download: bool = False, transform=None):  # type: ignore[no-untyped-def]
        n = TRAIN_SAMPLES if train else TEST_SAMPLES
        g = torch.Generator().manual_seed(1 if train else 2)
        self.images = torch.rand(n, 3, 32, 32, generator=g)
        self.labels = (
            torch.arange(n) % 10 if not train else torch.randint(0, 10, (n,), generator=g)
        ).tolist()
        self.transform = transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        x = self.images[i]
        return (self.transform(x) if self.transform else x), self.labels[i]


class _Compose:
    def __init__(self, steps: list[Any]) -> None:
        self.steps = steps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        for step in self.steps:
            x = step(x)
        return x


class _ToTensor:
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x  # the stand-in images are tensors in [0, 1] already


class _Normalize:
    def __init__(self, mean: Any, std: Any) -> None:
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std


def _install_torchvision() -> None:
    tv = types.ModuleType("torchvision")
    datasets = types.ModuleType("torchvision.datasets")
    transforms = types.ModuleType("torchvision.transforms")
    datasets.CIFAR10 = _SyntheticCIFAR10  # type: ignore[attr-defined]
    transforms.Compose, transforms.ToTensor = _Compose, _ToTensor  # type: ignore[attr-defined]
    transforms.Normalize = _Normalize  # type: ignore[attr-defined]
    tv.datasets, tv.transforms = datasets, transforms  # type: ignore[attr-defined]
    sys.modules.update(
        {"torchvision": tv, "torchvision.datasets": datasets, "torchvision.transforms": transforms}
    )


def run(source: str, workdir: str, reference: bool) -> list[float]:
    """Execute the script in this rank; the training losses it computed, in order.
    ``reference``: under the installed DeepSpeed (else under whatever ``deepspeed`` is)."""
    if reference:
        from tests.compat._deepspeed import import_deepspeed

        import_deepspeed()
    _install_torchvision()
    losses: list[float] = []
    forward = nn.CrossEntropyLoss.forward

    def recording(self: nn.CrossEntropyLoss, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = forward(self, *args, **kwargs)
        losses.append(float(out))
        return out

    nn.CrossEntropyLoss.forward = recording  # type: ignore[method-assign]
    old_argv, old_cwd = sys.argv, os.getcwd()
    sys.argv = [SCRIPT, *ARGS]
    os.chdir(workdir)
    torch.manual_seed(0)
    try:
        exec(compile(source, SCRIPT, "exec"), {"__name__": "__main__", "__file__": SCRIPT})
    finally:
        nn.CrossEntropyLoss.forward = forward  # type: ignore[method-assign]
        sys.argv = old_argv
        os.chdir(old_cwd)
    return losses
