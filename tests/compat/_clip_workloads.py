"""Rank-side runs for the gradient-clipping default: one SGD step on a linear model whose
gradient norm is far above 1, under slipstream and (when installed) DeepSpeed."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(8, 4)


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + rank)
    # Large inputs and targets: the gradient norm is in the hundreds, so clipping at 1 bites.
    return 30 * torch.randn(4, 8, generator=g), 30 * torch.randn(4, 4, generator=g)


def _config(stage: int, clip: float | None) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "SGD", "params": {"lr": 1.0}},
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,  # DeepSpeed asks for it with torch's SGD
    }
    if clip is not None:
        config["gradient_clipping"] = clip
    return config


def _one_step(initialize: Any, rank: int, stage: int, clip: float | None) -> dict[str, Any]:
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    engine, _, _, _ = initialize(
        model=model, model_parameters=model.parameters(), config=_config(stage, clip)
    )
    x, y = _batch(rank)
    loss = nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()
    with _full_params(engine, stage):
        after = [p.detach().clone().float() for p in engine.module.parameters()]
    delta = torch.cat([(a - b).flatten() for a, b in zip(after, before)])
    return {"update_norm": float(delta.norm()), "after": after, "grad_norm": _norm(engine)}


def _norm(engine: Any) -> float:
    norm = engine.get_global_grad_norm()
    return float(norm) if norm is not None else float("nan")


def _full_params(engine: Any, stage: int) -> Any:
    import contextlib

    if stage < 3:
        return contextlib.nullcontext()
    zero = __import__(type(engine).__module__.split(".")[0]).zero
    return zero.GatheredParameters(list(engine.module.parameters()))


def slipstream_runs() -> dict[str, Any]:
    """Stages 0, 2 and 3, each with the key absent and with 0.0."""
    import torch.distributed as dist

    import slipstream

    rank = dist.get_rank()
    return {
        (stage, clip): _one_step(slipstream.initialize, rank, stage, clip)
        for stage in (0, 2, 3)
        for clip in (None, 0.0)
    }


def deepspeed_runs() -> dict[str, Any]:
    """The same steps under the installed DeepSpeed (CPU accelerator, gloo)."""
    import torch.distributed as dist

    from tests.compat._deepspeed import import_deepspeed

    deepspeed = import_deepspeed()
    rank = dist.get_rank()
    return {
        (stage, clip): _one_step(deepspeed.initialize, rank, stage, clip)
        for stage in (0, 2)
        for clip in (None, 0.0)
    }
