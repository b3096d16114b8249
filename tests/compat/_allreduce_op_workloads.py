"""Rank side of tests/compat/test_allreduce_op.py: one SGD step of a tiny model with
``gradient_allreduce_op`` "mean" (stage 0) and "sum" (stages 0 and 2), each rank on its own
input; returns each run's parameter change. Then ``safe_set_full_grad`` at stage 2 in the
same world."""

from __future__ import annotations

import torch
import torch.distributed as dist

import slipstream


def sgd_step_deltas() -> dict[str, list[float]]:
    rank = dist.get_rank()
    out: dict[str, list[float]] = {}
    for stage, op in ((0, "mean"), (0, "sum"), (2, "sum")):  # the mean is the same at 2
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0,
            "gradient_allreduce_op": op.upper(),
            "optimizer": {"type": "SGD", "params": {"lr": 1.0}},
            "zero_optimization": {"stage": stage},
        }
        engine, *_ = slipstream.initialize(model=model, config=config)
        x = torch.full((1, 3), float(rank + 1))
        engine.backward(engine(x).pow(2).sum())
        engine.step()
        after = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
        out[f"{stage}-{op}"] = (after - before).tolist()
    out.update(_set_full_grad())
    return out


def _set_full_grad() -> dict[str, list[float]]:
    """``safe_set_full_grad`` at stage 2: the step applies the value set (SGD, lr 1)."""
    from slipstream.utils import safe_get_full_grad, safe_set_full_grad

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 1.0}},
        "zero_optimization": {"stage": 2},
    }
    engine, *_ = slipstream.initialize(model=model, config=config)
    before = model.weight.detach().clone()
    engine.backward(engine(torch.ones(1, 3)).sum())
    value = torch.arange(6.0).view(2, 3) / 10
    safe_set_full_grad(model.weight, value)
    read_back = safe_get_full_grad(model.weight)
    engine.step()
    return {
        "set_grad_delta": (model.weight.detach() - before).flatten().tolist(),
        "set_grad_read": read_back.flatten().tolist() if read_back is not None else [],
    }
