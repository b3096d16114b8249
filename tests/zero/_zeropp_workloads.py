"""ZeRO++ training runs at 4 ranks declared as 2 nodes x 2 (rank side)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

import slipstream
from slipstream.distributed import comm
from slipstream.models import GPT, GPTConfig

VARIANTS: dict[str, dict[str, Any]] = {
    "zero3": {},
    "qwz": {"zero_quantized_weights": True},
    "hpz": {"zero_hpz_partition_size": 2},
    "qgz": {"zero_quantized_gradients": True},
    "zeropp": {
        "zero_quantized_weights": True,
        "zero_hpz_partition_size": 2,
        "zero_quantized_gradients": True,
    },
}


def train(variant: str, steps: int, bf16: bool, preset: str = "tiny") -> dict[str, Any]:
    os.environ["SLIPSTREAM_RANKS_PER_NODE"] = "2"
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset(preset))
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, **VARIANTS[variant]}
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
        "zero_optimization": zero,
        "bf16": {"enabled": bf16},
    }
    engine, opt, _, _ = slipstream.initialize(model=model, config=config)
    g = torch.Generator().manual_seed(5)
    data = torch.randint(0, 64, (steps, 4 * world, 33), generator=g)  # small vocab: learnable
    data[:, :, 1::2] = data[:, :, 0:-1:2]  # every odd token repeats the one before it
    losses, cross, total = [], [], []
    for step in range(steps):
        batch = data[step, 4 * rank : 4 * rank + 4]
        comm.comm_counters.reset()
        loss = engine(batch[:, :-1], batch[:, 1:])
        engine.backward(loss)
        engine.step()
        cross.append(comm.comm_counters.cross_node_bytes())
        total.append(sum(e.bytes for e in comm.comm_counters.stats.values()))
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    per_op = {
        f"{axis}/{op}": (e.bytes, e.cross_node_bytes)
        for (axis, op), e in comm.comm_counters.stats.items()
    }
    secondary = opt.store.secondary_bytes()
    engine.destroy()
    return {
        "losses": losses,
        "cross": cross[-1],
        "total": total[-1],
        "per_op": per_op,
        "secondary_bytes": secondary,
    }


def both(steps: int) -> dict[str, Any]:
    return {v: train(v, steps, True)["per_op"] for v in ("zero3", "qwz")}


def all_variants(steps: int, bf16: bool) -> dict[str, dict[str, Any]]:
    return {v: train(v, steps, bf16) for v in VARIANTS}


def frozen_int8(root: str) -> dict[str, Any]:
    """Stage 3, bf16, block 1 frozen: int8 storage of the frozen block vs bf16 storage."""
    out: dict[str, Any] = {}
    for quantized in (False, True):
        torch.manual_seed(0)
        model = GPT(GPTConfig.preset("tiny"))
        for p in model.layers[1].parameters():
            p.requires_grad_(False)
        frozen_bf16 = sum(p.numel() * 2 for p in model.layers[1].parameters())
        config = {
            "train_micro_batch_size_per_gpu": 4,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
            "zero_optimization": {
                "stage": 3,
                "stage3_param_persistence_threshold": 0,
                "zero_quantized_nontrainable_weights": quantized,
            },
            "bf16": {"enabled": True},
        }
        engine, opt, _, _ = slipstream.initialize(model=model, config=config)
        g = torch.Generator().manual_seed(dist.get_rank())
        losses = []
        for _ in range(5):
            x = torch.randint(0, 256, (4, 33), generator=g)
            loss = engine(x[:, :-1], x[:, 1:])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        if quantized:
            engine.save_checkpoint(root, tag="q")
            out["stored"] = opt.store.frozen_bytes()
            out["bf16"] = frozen_bf16
            with slipstream.zero.GatheredParameters(list(model.layers[1].parameters())):
                out["frozen_values"] = model.layers[1].mlp.up_proj.weight.detach().clone()
        out[quantized] = losses
        engine.destroy()
    return out
