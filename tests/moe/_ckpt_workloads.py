"""MoE checkpoints across world size, ep_size and ZeRO stage: an AutoEP Mixtral (experts
stacked, Hugging Face names) and DeepSpeed's MoE layer (one module per expert), trained,
saved, loaded at the other ep_size and trained on."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tests.moe import _autoep_workloads as aw
from tests.moe import _ep_workloads as ew

WORLD, LR = 2, 0.05


def _model(kind: str, ep: int, rank: int) -> nn.Module:
    if kind == "autoep":
        return aw.build("mixtral")
    return ew.local_copy(ew.reference(2), ep, rank % ep, 2)


def _batch(kind: str, step: int, rank: int) -> Any:
    if kind == "autoep":
        return (aw.batch(rank, step),)
    return ew.batches(rank)[step % ew.STEPS]


def _loss(kind: str, engine: Any, batch: Any) -> torch.Tensor:
    if kind == "autoep":
        return engine(input_ids=batch[0], labels=batch[0]).loss
    return engine(*batch)


def both(ep: int, stage: int, load: str | None, save: str | None) -> dict[str, Any]:
    """:func:`run` for both kinds, in one world (``load``/``save`` are parent dirs)."""
    out = {}
    for kind in ("autoep", "deepspeed"):
        sub = [None if d is None else f"{d}/{kind}" for d in (load, save)]
        out[kind] = run(kind, ep, stage, sub[0], sub[1])
    return out


def run(kind: str, ep: int, stage: int, load: str | None, save: str | None) -> dict[str, Any]:
    """Build at ``ep`` on this world, load ``load`` (or train 2 steps and save ``save``),
    then train 2 more steps; return the continued losses (global-batch mean) and the
    parameters right after load/save."""
    import slipstream

    world = dist.get_world_size()
    rank = dist.get_rank()
    mine = [rank] if world == WORLD else list(range(WORLD))  # world 1 feeds both batches
    model = _model(kind, ep, rank)
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 1.0,
    }
    if kind == "autoep":
        config["expert_parallel"] = {"enabled": True, "autoep_size": ep}
    engine, _, _, _ = slipstream.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )

    def step(i: int) -> float:
        # One process averages both ranks' losses (the auxiliary loss is per forward).
        loss = sum(_loss(kind, engine, _batch(kind, i, r)) for r in mine) / len(mine)
        engine.backward(loss)
        engine.step()
        value = loss.detach().reshape(1).clone()
        dist.all_reduce(value)
        return float(value) / world

    if load is not None:
        engine.load_checkpoint(load)
    else:
        for i in range(2):
            step(i)
        engine.save_checkpoint(save, tag="t")
    with slipstream.zero.GatheredParameters(list(engine.module.parameters())):  # ZeRO-3
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    cont = [step(i) for i in (2, 3)]
    engine.destroy()
    return {"continued": cont, "params": params}


def export(path: str) -> dict[str, torch.Tensor]:
    from slipstream.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(path, tag="t")
