"""Ranks of tests/zero/test_comm_dtype.py: one bf16 backward at ZeRO-2/3, the averaged
gradient as ``safe_get_full_grad`` returns it, and each rank's own bf16 gradient."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

WIDTH = 64


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1))


def _batch(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 + rank)  # each rank its own data
    return torch.randn(4, WIDTH, generator=g) * (1 + 7 * rank)


def one_case(stage: int, comm: str | None) -> dict[str, Any]:
    import slipstream
    from slipstream.utils.tensor_fragment import safe_get_full_grad

    rank = dist.get_rank()
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "bf16": {"enabled": True},
        "gradient_clipping": 0.0,
    }
    if comm is not None:
        config["communication_data_type"] = comm
    x = _batch(rank)
    local = _model().to(torch.bfloat16)  # this rank's gradient, as DeepSpeed's ranks hold it
    local(x.to(torch.bfloat16)).pow(2).mean().backward()
    own = [p.grad.detach().clone() for p in local.parameters()]
    engine, *_ = slipstream.initialize(model=_model(), config=config)
    engine.backward(engine(x.to(torch.bfloat16)).pow(2).mean())
    full = [safe_get_full_grad(p) for p in engine.module.parameters()]
    engine.destroy()
    return {"own": own, "full": [g.detach().clone() for g in full if g is not None]}


def all_cases(_: Any = None) -> dict[tuple[int, str | None], dict[str, Any]]:
    return {(s, c): one_case(s, c) for s in (2, 3) for c in (None, "bf16")}
