"""Training workloads shared by the ZeRO parity tests: a distributed run and its reference."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

from slipstream.models import GPT, GPTConfig

STEPS = 5
GLOBAL_BATCH = 8
SEQ = 16
LR = 1e-3


def make_model(dtype: torch.dtype = torch.float32) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.preset("tiny")).to(dtype)


def make_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, 256, (GLOBAL_BATCH, SEQ + 1), generator=g)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def reference_run(bf16: bool, clip: float = 0.0) -> dict[str, Any]:
    """Single-process training on the whole global batch (fp32 master weights for bf16)."""
    model = make_model()
    masters = [p.detach().clone() for p in model.parameters()]
    if bf16:
        model.to(torch.bfloat16)
    opt = torch.optim.AdamW(masters, lr=LR, weight_decay=0.01)
    losses = []
    for x, y in make_batches():
        loss = model(x, y)
        loss.backward()
        for m, p in zip(masters, model.parameters()):
            m.grad = p.grad.float()
            p.grad = None
        if clip:
            torch.nn.utils.clip_grad_norm_(masters, clip)
        opt.step()
        with torch.no_grad():
            for m, p in zip(masters, model.parameters()):
                p.copy_(m)
        losses.append(float(loss.detach()))
    params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "params": params}


def engine_run(
    stage: int, bf16: bool, gas: int, clip: float = 0.0, bucket: int = 20_000
) -> dict[str, Any]:
    """The same training through slipstream on the current world; returns rank-0's view."""
    import slipstream

    world, rank = dist.get_world_size(), dist.get_rank()
    micro = GLOBAL_BATCH // (world * gas)
    config = {
        "train_batch_size": GLOBAL_BATCH,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": bucket,
            "stage3_param_persistence_threshold": 0,  # shard every block (the model is tiny)
        },
        "bf16": {"enabled": bf16},
        "gradient_clipping": clip,
    }
    engine, optimizer, _, _ = slipstream.initialize(model=make_model(), config=config)
    losses = []
    for x, y in make_batches():
        total = torch.zeros(())
        for m in range(gas):
            idx = slice((m * world + rank) * micro, (m * world + rank + 1) * micro)
            loss = engine(x[idx], y[idx])
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        dist.all_reduce(total)
        losses.append(float(total) / (world * gas))
    with slipstream.zero.GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    state = optimizer.state_bytes()
    engine.destroy()
    return {"losses": losses, "params": params, "state_bytes": state, "steps": engine.global_steps}


def matrix(configs: list[tuple[int, bool, int]]) -> dict[tuple[int, bool, int], dict[str, Any]]:
    """Run every (stage, bf16, gas) config in this world; used inside spawned ranks."""
    return {c: engine_run(*c) for c in configs}


def reference_state_bytes() -> int:
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model(*make_batches()[0]).backward()
    opt.step()
    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values())


def clone(d: dict[str, Any]) -> dict[str, Any]:
    return copy.deepcopy(d)
