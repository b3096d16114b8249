"""Rank bodies for moving a pipeline-parallel job from DeepSpeed 0.19.8 to slipstream.

DeepSpeed trains a 5-layer ``PipelineModule`` (2 stages on 2 ranks, 2 micro-batches per step,
ZeRO 0 or 1) for ``SAVED`` steps, saves (``layer_*`` and per-stage files) and goes on for
``MORE`` steps. slipstream loads the checkpoint into its own ``PipelineModule`` of the same
layers on 2 ranks, or into an ``nn.Sequential`` of them on 1 rank (the same parameter names),
and trains the same ``MORE`` steps on the same micro-batches.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

SAVED, MORE, MICRO, ACCUMULATION = 2, 3, 4, 2


def layers() -> list[nn.Module]:
    torch.manual_seed(5)
    return [nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 3)]


def config(stage: int, ds_stage: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": ACCUMULATION,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        # DeepSpeed's pipeline without ZeRO clips otherwise than its ZeRO-1 pipeline (which
        # slipstream matches, clipping on): with clipping its stage-0 run leaves the ZeRO-1
        # run's losses from the first clipped step; without, the two agree.
        "gradient_clipping": 0.0 if ds_stage == 0 else 1.0,
    }


def micro_batches(step: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The micro-batches from global step ``step`` on."""
    k = step * ACCUMULATION
    while True:
        g = torch.Generator().manual_seed(k)
        yield torch.randn(MICRO, 6, generator=g), torch.randn(MICRO, 3, generator=g)
        k += 1


def deepspeed_runs(root: str, stages: list[int]) -> dict[int, list[float]]:
    """DeepSpeed trains, saves ``root/ds_pipe_s<stage>`` and continues: its losses."""
    from tests.compat._deepspeed import import_deepspeed

    deepspeed = import_deepspeed()
    from deepspeed.pipe import PipelineModule

    deepspeed.init_distributed()
    out = {}
    for stage in stages:
        model = PipelineModule(layers=layers(), loss_fn=nn.MSELoss(), num_stages=2)
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config(stage, stage)
        )
        data = micro_batches(0)
        for _ in range(SAVED):
            engine.train_batch(data)
        engine.save_checkpoint(str(Path(root) / f"ds_pipe_s{stage}"), client_state={"epoch": 7})
        out[stage] = [float(engine.train_batch(data)) for _ in range(MORE)]
    return out


def slipstream_resumes(root: str, cases: list[tuple[int, int]]) -> dict[Any, Any]:
    """For each ``(DeepSpeed's stage, ZeRO stage)``: slipstream loads the checkpoint (into a
    2-stage pipeline at world 2, an ``nn.Sequential`` at world 1) and continues."""
    import slipstream
    from slipstream.pipe import PipelineModule

    out: dict[Any, Any] = {}
    for ds_stage, stage in cases:
        pipeline = dist.get_world_size() == 2
        if pipeline:
            model: nn.Module = PipelineModule(layers=layers(), loss_fn=nn.MSELoss(), num_stages=2)
        else:
            model = nn.Sequential(*layers())
        engine, *_ = slipstream.initialize(model=model, config=config(stage, ds_stage))
        _, client = engine.load_checkpoint(str(Path(root) / f"ds_pipe_s{ds_stage}"))
        data = micro_batches(SAVED)
        losses = []
        for _ in range(MORE):
            if pipeline:
                losses.append(float(engine.train_batch(data)))
                continue
            total = 0.0
            for _ in range(ACCUMULATION):
                x, y = next(data)
                loss = nn.functional.mse_loss(engine(x), y)
                engine.backward(loss)
                engine.step()
                total += loss.item()
            losses.append(total / ACCUMULATION)
        out[(ds_stage, stage)] = {
            "losses": losses,
            "steps": engine.global_steps,
            "epoch": (client or {}).get("epoch"),
        }
        engine.destroy()
    return out
