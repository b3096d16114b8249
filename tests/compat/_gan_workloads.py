"""Rank-side runs of engine semantics real scripts rely on. The DCGAN training pattern: two engines, the discriminator's real and
fake losses backwarded separately before one step, the generator's loss backwarded through
the discriminator. Under slipstream at stages 0-3, under DeepSpeed, and in plain PyTorch on
the global batch (the reference). A pipeline whose second stage starts with an in-place
layer."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

STEPS = 3
PER_RANK = 4


def models() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    disc = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1), nn.Sigmoid(), nn.Flatten(0))
    gen = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 6))
    return disc, gen


def batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(real samples, noise) for each step of this rank."""
    g = torch.Generator().manual_seed(100 + rank)
    return [
        (torch.randn(PER_RANK, 6, generator=g), torch.randn(PER_RANK, 3, generator=g))
        for _ in range(STEPS)
    ]


def config(stage: int) -> dict[str, Any]:
    return {
        "train_batch_size": 2 * PER_RANK,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01, "betas": [0.5, 0.999]}},
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 0.0,
    }


def train(
    disc: nn.Module,
    gen: nn.Module,
    back_d: Any,
    step_d: Any,
    back_g: Any,
    step_g: Any,
    data: list[tuple[torch.Tensor, torch.Tensor]],
    zero_disc: bool,
) -> list[tuple[float, float, float]]:
    """The DCGAN loop; ``zero_disc``: call ``disc.zero_grad()`` first, as the example does
    (without it the generator's gradients on the discriminator join its next step)."""
    bce = nn.BCELoss()
    losses = []
    for real, noise in data:
        if zero_disc:
            disc.zero_grad()
        err_real = bce(disc(real), torch.ones(len(real)))
        back_d(err_real)
        fake = gen(noise)
        err_fake = bce(disc(fake.detach()), torch.zeros(len(real)))
        back_d(err_fake)
        step_d()
        gen.zero_grad()
        err_gen = bce(disc(fake), torch.ones(len(real)))
        back_g(err_gen)
        step_g()
        losses.append((err_real.item(), err_fake.item(), err_gen.item()))
    return losses


def run_engines(initialize: Any, zero: Any, stage: int, zero_disc: bool) -> dict[str, Any]:
    import torch.distributed as dist

    disc, gen = models()
    eng_d, *_ = initialize(model=disc, model_parameters=disc.parameters(), config=config(stage))
    eng_g, *_ = initialize(model=gen, model_parameters=gen.parameters(), config=config(stage))
    data = batches(dist.get_rank())
    losses = train(
        disc, gen, eng_d.backward, eng_d.step, eng_g.backward, eng_g.step, data, zero_disc
    )
    params = list(disc.parameters()) + list(gen.parameters())
    gathered = zero.GatheredParameters(params) if stage == 3 else contextlib.nullcontext()
    with gathered:
        return {"losses": losses, "params": [p.detach().clone() for p in params]}


def reference(zero_disc: bool, world: int = 2) -> dict[str, Any]:
    """Plain PyTorch on the concatenated batches of every rank (the per-rank means averaged
    over ranks are the global means: equal batch sizes)."""
    disc, gen = models()
    opt_d = torch.optim.Adam(disc.parameters(), lr=0.01, betas=(0.5, 0.999))
    opt_g = torch.optim.Adam(gen.parameters(), lr=0.01, betas=(0.5, 0.999))
    per_rank = [batches(r) for r in range(world)]
    data = [tuple(torch.cat(parts) for parts in zip(*steps)) for steps in zip(*per_rank)]

    def step_d() -> None:
        opt_d.step()
        opt_d.zero_grad()

    def step_g() -> None:
        opt_g.step()
        opt_g.zero_grad()

    def back(loss: torch.Tensor) -> None:
        loss.backward()

    train(disc, gen, back, step_d, back, step_g, data, zero_disc)  # type: ignore[arg-type]
    return {
        "params": [p.detach().clone() for p in list(disc.parameters()) + list(gen.parameters())]
    }


def stray_gradients() -> str:
    """loss.backward() instead of engine.backward(loss), then engine.step(): refused."""
    import slipstream

    disc, _ = models()
    engine, *_ = slipstream.initialize(
        model=disc, model_parameters=disc.parameters(), config=config(1)
    )
    engine(torch.randn(PER_RANK, 6)).mean().backward()
    try:
        engine.step()
    except RuntimeError as e:
        return str(e)
    return "no error"


def slipstream_runs() -> dict[Any, Any]:
    import slipstream

    out: dict[Any, Any] = {
        (stage, zero_disc): run_engines(slipstream.initialize, slipstream.zero, stage, zero_disc)
        for stage in (0, 1, 2, 3)
        for zero_disc in (True, False)
    }
    out["stray"] = stray_gradients()
    out["inplace_pipeline"] = inplace_pipeline()
    return out


def _pipe_data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(2, 4, generator=g), torch.randn(2, 1, generator=g)) for _ in range(4)]


def _pipe_layers() -> list[nn.Module]:
    torch.manual_seed(1)
    return [nn.Linear(4, 8), nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 1)]


def inplace_pipeline() -> dict[str, Any]:
    """Two stages cut uniformly (DeepSpeed's [0, 2, 4]): stage 1 starts with
    ReLU(inplace=True) on the received activation. Two steps of two micro-batches."""
    import slipstream
    from slipstream.pipe import PipelineModule

    module = PipelineModule(
        _pipe_layers(), num_stages=2, loss_fn=nn.MSELoss(), partition_method="uniform"
    )
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "gradient_clipping": 0.0,
    }
    engine, *_ = slipstream.initialize(model=module, config=config)
    data = iter(_pipe_data())
    losses = [float(engine.train_batch(data)) for _ in range(2)]
    return {"parts": list(module.parts), "losses": losses}


def inplace_pipeline_reference() -> list[float]:
    model = nn.Sequential(*_pipe_layers())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data, losses = _pipe_data(), []
    for step in range(2):
        micro = data[2 * step : 2 * step + 2]
        loss = sum(nn.functional.mse_loss(model(x), y) for x, y in micro) / 2
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


def deepspeed_runs() -> dict[Any, Any]:
    """Stage 0 only: DeepSpeed 0.19.8 keeps only the last backward's gradients at stage 1
    and refuses a second reduction at stages 2 and 3 (docs/compatibility.md)."""
    from tests.compat._deepspeed import import_deepspeed

    deepspeed = import_deepspeed()
    return {
        (0, zero_disc): run_engines(deepspeed.initialize, deepspeed.zero, 0, zero_disc)
        for zero_disc in (True, False)
    }
