"""Rank bodies for moving a job between DeepSpeed 0.19.8 and slipstream through checkpoints.

DeepSpeed trains ``SAVED`` steps, saves, and goes on for ``MORE`` steps (its own
continuation); slipstream loads the DeepSpeed checkpoint at the same or another world size and
ZeRO stage and trains the same ``MORE`` steps on the same global batches. At world 1 a rank
sees the two ranks' micro-batches as one batch: the same global batch and mean loss.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import slipstream

SAVED, MORE = 3, 3
MICRO = 4  # per rank at world 2
DS_WORLD = 2


def model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 3))


def config(stage: int, world: int, bf16: bool = False) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MICRO * DS_WORLD // world,
        "gradient_accumulation_steps": 1,
        # torch_adam: torch's AdamW in DeepSpeed too (its fused CPU Adam is JIT-compiled).
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 0.01, "weight_decay": 0.1, "torch_adam": True},
        },
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}},
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": bf16},
    }


def batch(step: int, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s inputs of global step ``step`` (both DeepSpeed ranks' at world 1)."""
    per_rank = [
        torch.randn(MICRO, 6, generator=torch.Generator().manual_seed(1000 * step + r))
        for r in range(DS_WORLD)
    ]
    if world == 1:
        return torch.cat(per_rank)
    return per_rank[rank]


def _train(engine: Any, steps: range, bf16: bool) -> list[float]:
    """Each step's loss averaged over the ranks (the global batch's mean)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in steps:
        x = batch(step, rank, world).to(engine.device)
        out = engine(x.bfloat16() if bf16 else x)
        loss = out.float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses


def _to_universal(save: Path, out: Path) -> None:
    """DeepSpeed's own ds_to_universal (rank 0) of ``save``'s latest tag into ``out``."""
    from types import SimpleNamespace

    dist.barrier()
    if dist.get_rank() == 0:
        from deepspeed.checkpoint.ds_to_universal import main as to_universal

        tag = (save / "latest").read_text().strip()
        out.mkdir(parents=True)
        args = SimpleNamespace(
            input_folder=str(save / tag),
            output_folder=str(out / tag),
            num_extract_workers=1,
            num_merge_workers=1,
            keep_temp_folder=False,
            strict=True,
            inject_missing_state=False,
        )
        to_universal(args)  # writes out/latest_universal
    dist.barrier()


def deepspeed_runs(
    root: str, cases: list[tuple[int, bool]], universal: bool = False
) -> dict[Any, Any]:
    """DeepSpeed trains, saves ``root/ds_s<stage>[_bf16]`` (and with ``universal`` converts
    the ZeRO-2 fp32 one with its ds_to_universal into ``root/ds_uni``), and continues: its
    losses."""
    from tests.compat._deepspeed import import_deepspeed

    deepspeed = import_deepspeed()
    out: dict[Any, Any] = {}
    for stage, bf16 in cases:
        m = model()
        engine, *_ = deepspeed.initialize(
            model=m, model_parameters=m.parameters(), config=config(stage, DS_WORLD, bf16)
        )
        _train(engine, range(SAVED), bf16)
        save = Path(root) / f"ds_s{stage}{'_bf16' if bf16 else ''}"
        # universal_checkpoint_info: what DeepSpeed's ds_to_universal requires of a client.
        client = {"epoch": 7, "universal_checkpoint_info": {}}
        engine.save_checkpoint(str(save), client_state=client)
        if universal and (stage, bf16) == (2, False):
            _to_universal(save, Path(root) / "ds_uni")
        out[(stage, bf16)] = _train(engine, range(SAVED, SAVED + MORE), bf16)
    return out


def slipstream_resumes(root: str, cases: list[tuple[Any, ...]]) -> dict[Any, Any]:
    """slipstream loads each DeepSpeed checkpoint (saved at ``ds_stage``) at ZeRO ``stage``
    and this world size (with the optimizer states unless the case says False) and
    continues: its losses, counters, client state."""
    out: dict[Any, Any] = {}
    for ds_stage, bf16, stage, *rest in cases:
        engine, *_ = slipstream.initialize(
            model=model(seed=5), config=config(stage, dist.get_world_size(), bf16)
        )
        sub = ds_stage if isinstance(ds_stage, str) else f"ds_s{ds_stage}{'_bf16' if bf16 else ''}"
        path, client = engine.load_checkpoint(
            str(Path(root) / sub),
            load_optimizer_states=rest[0] if rest else True,
        )
        counters = (engine.global_steps, engine.global_samples, engine.skipped_steps)
        lr = engine.lr_scheduler.state_dict()
        losses = _train(engine, range(SAVED, SAVED + MORE), bf16)
        out[(ds_stage, bf16, stage, *rest)] = {
            "losses": losses,
            "path": path,
            "epoch": (client or {}).get("epoch"),
            "counters": counters,
            "lr_scheduler": lr,
            "after": engine.global_samples,
        }
        engine.destroy()
    return out


def slipstream_loads_with_sgd(root: str) -> str:
    """An engine with another optimizer than the DeepSpeed run's: the error it gets."""
    cfg = config(2, dist.get_world_size())
    cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}
    engine, *_ = slipstream.initialize(model=model(), config=cfg)
    try:
        engine.load_checkpoint(str(Path(root) / "ds_s2"))
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "loaded"


def slipstream_saves(root: str, stage: int) -> list[float]:
    """slipstream trains, saves ``root/ss``, and continues: its losses."""
    engine, *_ = slipstream.initialize(model=model(), config=config(stage, dist.get_world_size()))
    _train(engine, range(SAVED), False)
    engine.save_checkpoint(str(Path(root) / "ss"), client_state={"epoch": 7})
    return _train(engine, range(SAVED, SAVED + MORE), False)


def deepspeed_resumes(root: str, cases: list[tuple[str, int, int | None]]) -> dict[str, Any]:
    """DeepSpeed loads each DeepSpeed-layout export ``root/<sub>`` at ZeRO ``stage`` (with
    ``sub_group_size`` when given) and continues."""
    from tests.compat._deepspeed import import_deepspeed

    deepspeed = import_deepspeed()
    out = {}
    for sub, stage, sub_group_size in cases:
        m = model(seed=5)
        cfg = config(stage, DS_WORLD)
        if sub_group_size is not None:
            cfg["zero_optimization"]["sub_group_size"] = sub_group_size
        engine, *_ = deepspeed.initialize(model=m, model_parameters=m.parameters(), config=cfg)
        _, client = engine.load_checkpoint(str(Path(root) / sub))
        counters = (engine.global_steps, engine.global_samples, engine.skipped_steps)
        out[sub] = {
            "losses": _train(engine, range(SAVED, SAVED + MORE), False),
            "counters": counters,
            "epoch": (client or {}).get("epoch"),
        }
        engine.destroy()
    return out
