"""A Lightning ``Trainer.fit`` on 2 CPU processes with ``DeepSpeedStrategy`` (or DDP), as a
Lightning user writes it: a ``LightningModule`` whose layers are built in ``configure_model``
(under ``deepspeed.zero.Init`` at stage 3), a client ``torch.optim.AdamW``, a
``DataLoader`` that Lightning shards. Lightning launches the second process itself.

    python lightning_fit.py --strategy deepspeed --stage 3 --out losses.json

Lightning refuses ``DeepSpeedStrategy`` on anything but CUDA, in ``setup_environment`` only;
the changes here are a subclass that skips that check (and the one that device indices
equal local ranks: CPU devices have none) and sets the stage-3 persistence
threshold to 0 in the config Lightning writes (everything else is Lightning's own
code: the config it writes, ``deepspeed.init_distributed``, ``zero.Init``,
``deepspeed.initialize``, ``engine.backward``/``step``). Under DeepSpeed itself the
shared-memory all-reduce op it would JIT-build is stubbed, as ``tests/compat/_deepspeed.py``
does, and ``deepspeed.initialize`` gets the local rank as ``args.device_rank`` where Lightning
passes the CPU device's index, None (DeepSpeed compares it with 0). Rank 0 writes every rank's loss per
step (the mean over ranks) to ``--out``. ``DS_ACCELERATOR=cpu`` is set for DeepSpeed itself.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

os.environ.setdefault("DS_ACCELERATOR", "cpu")
if os.environ.get("SLIPSTREAM_AS_DEEPSPEED") != "1":
    try:  # DeepSpeed itself: its shared-memory all-reduce op is JIT-built and never used here
        import deepspeed.comm.torch as _ds_torch

        _ds_torch.build_shm_op = lambda: None  # DeepSpeed's own "op not available" value
        import deepspeed as _ds

        _ds_initialize = _ds.initialize

        def _initialize_on_cpu(*args: Any, **kwargs: Any) -> Any:
            # Lightning passes args.device_rank = root_device.index, None on a CPU, which
            # DeepSpeed compares with 0 (TypeError); its own launcher would give the local rank.
            ns = kwargs.get("args")
            if ns is not None and getattr(ns, "device_rank", 0) is None:
                ns.device_rank = int(os.environ.get("LOCAL_RANK", "0"))
            return _ds_initialize(*args, **kwargs)

        _ds.initialize = _initialize_on_cpu
    except ImportError:
        pass

import lightning as L
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

STEPS = 6
MICRO = 4
WIDTH = 32


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    """Lightning's DeepSpeedStrategy without its CUDA-only check."""

    def setup_environment(self) -> None:
        DDPStrategy.setup_environment(self)

    def setup_distributed(self) -> None:
        # Lightning's, less the check that device indices equal local ranks (CPU devices
        # have no index).
        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    def _create_default_config(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        # Lightning's own config (its aio block included), with every parameter partitioned
        # at stage 3 (the model is far below the 1e5-element persistence default).
        config: dict[str, Any] = super()._create_default_config(*args, **kwargs)
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        return config


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net: nn.Module | None = None
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.net is not None:
            return
        torch.manual_seed(0)
        blocks = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(3)]
        self.net = nn.Sequential(nn.Linear(8, WIDTH), *blocks, nn.Linear(WIDTH, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], idx: int) -> torch.Tensor:
        x, y = batch
        assert self.net is not None
        loss = nn.functional.mse_loss(self.net(x), y)
        every = self.all_gather(loss.detach())
        self.losses.append(float(every.mean()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)


def data() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS * MICRO * 2, 8, generator=g)
    y = x[:, :1] * 0.5 - x[:, 1:2] ** 2 + 0.1 * torch.randn(len(x), 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=MICRO, shuffle=False)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=["ddp", "deepspeed"], required=True)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.strategy == "ddp":
        strategy: L.pytorch.strategies.Strategy = DDPStrategy()
    else:
        strategy = CPUDeepSpeedStrategy(stage=args.stage)
    model = Regressor()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=STEPS,
        precision="32-true",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, data())
    if trainer.global_rank == 0:
        with open(args.out, "w") as f:
            json.dump({"losses": model.losses, "steps": trainer.global_step}, f)


if __name__ == "__main__":
    main()
