"""Rank side of tests/compat/test_allreduce_op.py: one SGD step of a tiny model with
``gradient_allreduce_op`` "mean" (stage 0) and "sum" (stages 0 and 2), each rank on its own
input; returns each run's parameter change."""

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
    return out
