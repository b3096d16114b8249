"""Rank-side runs for ``slipstream.utils``: the safe_get/set helpers at every ZeRO stage
against an independent single-process reference, and zero_to_fp32 on the saved checkpoint."""

from __future__ import annotations

import copy
import tempfile
from typing import Any

import torch
from torch import nn

BETAS = (0.9, 0.999)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(20 + rank)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def _reference_grads(model: nn.Module, world: int) -> dict[str, torch.Tensor]:
    """The data-parallel average gradient, computed on one process from every rank's batch."""
    ref = copy.deepcopy(model)
    for rank in range(world):
        x, y = _batch(rank)
        (nn.functional.mse_loss(ref(x), y) / world).backward()
    return {n: p.grad.clone() for n, p in ref.named_parameters()}


def _run_stage(stage: int, bf16: bool) -> dict[str, Any]:
    import torch.distributed as dist

    import slipstream
    from slipstream import utils
    from slipstream.utils import zero_to_fp32

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model()
    ref_grads = _reference_grads(model, world)
    names = [n for n, _ in model.named_parameters()]
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": BETAS}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "bf16": {"enabled": bf16},
        "gradient_clipping": 0.0,
    }
    engine, *_ = slipstream.initialize(model=model, config=config)
    params = dict(engine.module.named_parameters())
    x, y = _batch(rank)
    dtype = next(engine.module.parameters()).dtype
    engine.backward(nn.functional.mse_loss(engine(x.to(dtype)).float(), y))
    out: dict[str, Any] = {"ref_grads": ref_grads}
    out["grads"] = {n: utils.safe_get_full_grad(params[n]).float() for n in names}
    out["before_step_state"] = utils.safe_get_full_optimizer_state(params[names[0]], "exp_avg")
    engine.step()
    out["fp32"] = {n: utils.safe_get_full_fp32_param(params[n]) for n in names}
    out["exp_avg"] = {n: utils.safe_get_full_optimizer_state(params[n], "exp_avg") for n in names}
    with slipstream.zero.GatheredParameters(list(params.values())):
        out["module"] = {n: params[n].detach().float().clone() for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        shared = [tmp]
        dist.broadcast_object_list(shared, src=0)
        engine.save_checkpoint(shared[0], tag="t1")
        dist.barrier()
        if rank == 0:
            out["from_ckpt"] = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(shared[0])
            zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(shared[0], f"{tmp}/bin")
            out["bin"] = torch.load(f"{tmp}/bin/pytorch_model.bin", weights_only=True)
        dist.barrier()
    # Setters: every rank passes the same full value.
    first = names[0]
    new = torch.arange(out["fp32"][first].numel()).float().reshape(out["fp32"][first].shape) / 10
    utils.safe_set_full_fp32_param(params[first], new)
    utils.safe_set_full_optimizer_state(params[first], new * 2, "exp_avg")
    out["set_fp32"] = utils.safe_get_full_fp32_param(params[first])
    out["set_state"] = utils.safe_get_full_optimizer_state(params[first], "exp_avg")
    with slipstream.zero.GatheredParameters([params[first]]):
        out["set_module"] = params[first].detach().float().clone()
    out["new"] = new
    out["frozen_is_none"] = utils.safe_get_full_fp32_param(torch.nn.Parameter(torch.ones(2)))
    engine.destroy()
    return out


def utils_runs() -> dict[Any, Any]:
    return {
        (stage, bf16): _run_stage(stage, bf16)
        for stage, bf16 in ((0, False), (1, False), (2, True), (3, False))
    }
