"""Rank bodies for moving a mixture-of-experts job from DeepSpeed 0.19.8 to slipstream.

DeepSpeed trains a small model around ``deepspeed.moe.layer.MoE`` (4 experts, ``ep_size`` 1 or
2) for ``SAVED`` steps at ZeRO-2 on 2 ranks, saves, and goes on for ``MORE`` steps (its own
continuation). slipstream builds the same model around ``slipstream.moe.MoE`` (the same module
names) at the same or another ``ep_size`` and world size, loads the DeepSpeed checkpoint and
trains the same ``MORE`` steps on the same global batches. Routing is deterministic (top-1,
no token dropping, no random token selection), so both see the same computation. At world 1
the two DeepSpeed ranks' micro-batches are two accumulation steps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

SAVED, MORE = 2, 3
MICRO = 4  # per rank at world 2
DS_WORLD = 2


class Net(nn.Module):
    def __init__(self, moe_cls: Any, ep_size: int) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        expert = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
        self.moe = moe_cls(8, expert, num_experts=4, ep_size=ep_size, k=1, drop_tokens=False,
                           use_rts=False)  # fmt: skip
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, l_aux, _ = self.moe(torch.tanh(self.inp(x)))
        return self.head(h).pow(2).mean() + 0.01 * l_aux


def config(world: int, stage: int = 2) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": DS_WORLD // world,
        # torch_adam: torch's AdamW in DeepSpeed too (its fused CPU Adam is JIT-compiled).
        "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
    }


def saved_dir(root: str, ep: int, stage: int) -> Path:
    """Where DeepSpeed saved the run of ``ep_size`` ``ep`` at ZeRO ``stage``."""
    return Path(root) / (f"ds_moe_ep{ep}" if stage == 2 else f"ds_moe_ep{ep}_s{stage}")


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(MICRO, 6, generator=torch.Generator().manual_seed(100 * step + rank))


def _train(engine: Any, steps: range) -> list[float]:
    """Each step's loss averaged over the DeepSpeed ranks' micro-batches."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = [rank] if world == DS_WORLD else list(range(DS_WORLD))
    losses = []
    for step in steps:
        total = torch.zeros(())
        for r in mine:
            loss = engine(batch(step, r))
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        dist.all_reduce(total)
        losses.append(total.item() / DS_WORLD)
    return losses


def deepspeed_runs(root: str, cases: list[tuple[int, int]]) -> dict[Any, list[float]]:
    """For each ``(ep_size, ZeRO stage)``: DeepSpeed trains, saves in ``saved_dir`` and
    continues: its losses."""
    from tests.compat._deepspeed import import_deepspeed

    deepspeed = import_deepspeed()
    from deepspeed.moe.layer import MoE

    out = {}
    for ep, stage in cases:
        torch.manual_seed(0)
        m = Net(MoE, ep)
        engine, *_ = deepspeed.initialize(
            model=m, model_parameters=m.parameters(), config=config(DS_WORLD, stage)
        )
        _train(engine, range(SAVED))
        engine.save_checkpoint(str(saved_dir(root, ep, stage)), client_state={"epoch": 7})
        out[(ep, stage)] = _train(engine, range(SAVED, SAVED + MORE))
    return out


def slipstream_resumes(root: str, cases: list[tuple[int, int, int, int]]) -> dict[Any, Any]:
    """For each ``(saved ep_size, saved stage, ep_size, stage)``: slipstream loads the
    DeepSpeed checkpoint into its own MoE at ``ep_size`` and ZeRO ``stage`` on this world and
    continues."""
    import slipstream
    from slipstream.checkpoint.state import placed
    from slipstream.moe import MoE

    out: dict[Any, Any] = {}
    for saved_ep, saved_stage, ep, stage in cases:
        torch.manual_seed(5)
        cfg = dict(config(dist.get_world_size()), zero_optimization={"stage": stage})
        engine, *_ = slipstream.initialize(model=Net(MoE, ep), config=cfg)
        _, client = engine.load_checkpoint(str(saved_dir(root, saved_ep, saved_stage)))
        counters = (engine.global_steps, engine.global_samples)
        experts = {  # this rank's experts after the load, by global name
            placed(n, p, tuple(p.shape))[0]: p.detach().clone()
            for n, p in engine.module.named_parameters()
            if "deepspeed_experts" in n
        }
        out[(saved_ep, saved_stage, ep, stage)] = {
            "experts": experts,
            "losses": _train(engine, range(SAVED, SAVED + MORE)),
            "counters": counters,
            "epoch": (client or {}).get("epoch"),
        }
        engine.destroy()
    return out
