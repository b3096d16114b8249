"""Rank-side run for the DeepSpeed engine attributes (fall-through, counters, helpers)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn


class Tagged(nn.Module):
    """A model with its own attribute and method, as HF models have (config, generate)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 4)
        self.tag = "mine"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).square().mean()

    def describe(self) -> str:
        return f"tagged {self.tag}"


def attributes() -> dict[str, Any]:
    import torch.distributed as dist

    import slipstream

    out: dict[str, Any] = {}
    for stage in (1, 3):
        torch.manual_seed(0)
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            **({"steps_per_print": 3} if stage == 3 else {}),
        }
        engine, *_ = slipstream.initialize(model=Tagged(), config=config)
        rates = []
        for _ in range(4):
            engine.backward(engine(torch.randn(2, 4)))
            engine.step()
            rates.append(engine.tput_timer.avg_samples_per_sec())
        try:
            engine.no_such_thing  # noqa: B018 - the look-up is the test
        except AttributeError as e:
            missing = str(e)
        with tempfile.TemporaryDirectory() as tmp:
            shared = [tmp]
            dist.broadcast_object_list(shared, src=0)
            saved = engine.save_fp16_model(shared[0])
            files = sorted(p.name for p in Path(shared[0]).iterdir())
            dist.barrier()
        store = engine.optimizer.store
        for unit in getattr(store, "units", []):  # stage 3: gather as a forward would
            store.gather(unit)
        gathered = any(p.numel() > 0 for p in engine.module.parameters())
        engine.empty_partition_cache()
        out[stage] = {
            "tag": engine.tag,
            "describe": engine.describe(),
            "rates": rates,
            "missing": missing,
            "world_size": engine.world_size,
            "mp_world_size": engine.mp_world_size,
            "dp_group_size": dist.get_world_size(engine.data_parallel_group),
            "steps_per_print": engine.steps_per_print(),
            "wall_clock_breakdown": engine.wall_clock_breakdown(),
            "partition_gradients": engine.zero_optimization_partition_gradients(),
            "saved": saved,
            "files": files,
            "gathered": gathered,
            "released": all(p.numel() == 0 for p in engine.module.parameters()),
        }
        engine.destroy()
    return out
