"""Rank-side runs for the non-finite gradient tests: a NaN/inf loss injected at one step."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

import slipstream
from slipstream._logging import logger
from slipstream.models import GPT, GPTConfig
from slipstream.precision import NonFiniteGradientError

BAD_STEP = 1  # the 0-based step whose loss is poisoned (logged as step 2)


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.preset("tiny"))


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    t = torch.randint(0, 256, (2, 17), generator=g)
    return t[:, :-1], t[:, 1:]


def _config(precision: str, stage: int, mode: str, tp: int = 1) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        # The lr changes every step, so a scheduler stepped on the skipped step would show.
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 1e-3, "warmup_num_steps": 10, "warmup_type": "linear"},
        },
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "bf16": {"enabled": precision == "bf16"},
        "nonfinite_gradients": mode,
        "tensor_parallel": {"autotp_size": tp},
    }


def _snapshot(engine: Any) -> list[torch.Tensor]:
    """This rank's copy of everything a step may change: masters, parameter storage, states."""
    opt = engine.optimizer
    out = [m.detach().clone() for m in opt.masters]
    out += [opt.store.owned(b.index).detach().clone() for b in opt.buckets]
    for state in opt.state.values():
        out += [v.detach().clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return out


def _unchanged(before: list[torch.Tensor], after: list[torch.Tensor]) -> bool:
    return len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))


def _poison(loss: torch.Tensor, poison: str | None) -> torch.Tensor:
    """``poison`` names the ranks whose loss turns non-finite: "one" is rank 1 (nan), "all"
    every rank (nan), "inf" every rank (inf); None none."""
    if poison == "inf":
        return loss * float("inf")
    if poison == "all" or (poison == "one" and dist.get_rank() == 1):
        return loss * float("nan")
    return loss


def _train(
    precision: str, stage: int, poison: str | None, steps: int, tp: int = 1
) -> dict[str, Any]:
    """``steps`` steps; the loss of step ``BAD_STEP`` is poisoned (see ``_poison``)."""
    config = _config(precision, stage, "skip", tp)
    engine, *_ = slipstream.initialize(model=_model(), config=config)
    rank = dist.get_rank()
    x, y = _batch(rank // tp)  # tensor-parallel ranks share their data
    out: dict[str, Any] = {"applied": [], "lrs": [], "losses": []}
    for step in range(steps):
        loss = engine(x, y)
        if step == BAD_STEP:
            loss = _poison(loss, poison)
        before = _snapshot(engine)
        engine.backward(loss)
        engine.step()
        if step == BAD_STEP:
            out["bad_step_unchanged"] = _unchanged(before, _snapshot(engine))
        out["applied"].append(engine.was_step_applied())
        out["lrs"].append(engine.get_lr()[0])
        out["losses"].append(float(loss.detach()))
    out["final"] = [m.detach().float().clone() for m in engine.optimizer.masters]
    out["skipped"], out["global_steps"] = engine.skipped_steps, engine.global_steps
    out["norm"] = engine.get_global_grad_norm()
    engine.destroy()
    return out


def _train_pipeline(precision: str, stage: int, poison: str | None, steps: int) -> dict[str, Any]:
    """As ``_train`` for a 2-stage ``PipelineModule``: the loss exists on the last stage
    (rank 1) only, so poisoning it poisons one rank."""
    from slipstream.models.gpt_pipeline import gpt_loss, gpt_pipeline_layers
    from slipstream.pipe import PipelineModule
    from tests.parallel._pipe_workloads import gpt_config

    state = {"step": 0}

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = gpt_loss(logits, labels)
        return _poison(loss, poison) if state["step"] == BAD_STEP else loss

    torch.manual_seed(0)
    module = PipelineModule(gpt_pipeline_layers(gpt_config()), num_stages=2, loss_fn=loss_fn)
    config = _config(precision, stage, "skip")
    engine, *_ = slipstream.initialize(model=module, config=config)
    x, y = _batch(0)
    x, y = x % 64, y % 64  # the pipeline GPT's vocabulary
    out: dict[str, Any] = {"applied": [], "lrs": [], "losses": []}
    for step in range(steps):
        state["step"] = step
        before = _snapshot(engine)
        loss = engine.train_batch(iter([(x, y)]))
        if step == BAD_STEP:
            out["bad_step_unchanged"] = _unchanged(before, _snapshot(engine))
        out["applied"].append(engine.was_step_applied())
        out["lrs"].append(engine.get_lr()[0])
        out["losses"].append(float(loss))
    out["final"] = [m.detach().float().clone() for m in engine.optimizer.masters]
    out["skipped"], out["global_steps"] = engine.skipped_steps, engine.global_steps
    engine.destroy()
    return out


def skip_case(precision: str, stage: int, poison: str, parallel: str = "dp") -> dict[str, Any]:
    """A poisoned run (4 steps, one skipped) and a clean one of 3 steps, which the poisoned
    run must match: the skipped step may leave no trace. ``parallel``: "dp" (2 data-parallel
    ranks), "tp" (2 tensor-parallel ranks) or "pp" (2 pipeline stages)."""
    if parallel == "pp":
        run = _train_pipeline
    else:
        tp = 2 if parallel == "tp" else 1

        def run(precision: str, stage: int, poison: str | None, steps: int) -> dict[str, Any]:
            return _train(precision, stage, poison, steps, tp)

    capture = _Capture()
    logger.addHandler(capture)
    try:
        poisoned = run(precision, stage, poison, 4)
    finally:
        logger.removeHandler(capture)
    poisoned["warnings"] = capture.lines
    clean = run(precision, stage, None, 3)
    return {"poisoned": poisoned, "clean": clean}


def error_case(precision: str, stage: int) -> dict[str, Any]:
    """``nonfinite_gradients: "error"`` with a nan loss on rank 1 only: every rank raises."""
    engine, *_ = slipstream.initialize(model=_model(), config=_config(precision, stage, "error"))
    rank = dist.get_rank()
    x, y = _batch(rank)
    out: dict[str, Any] = {"error": None}
    for step in range(3):
        loss = engine(x, y)
        if step == BAD_STEP and rank == 1:
            loss = loss * float("nan")
        before = _snapshot(engine)
        engine.backward(loss)
        try:
            engine.step()
        except NonFiniteGradientError as exc:
            out.update(error=str(exc), at=step, unchanged=_unchanged(before, _snapshot(engine)))
            break
    out["skipped"], out["global_steps"] = engine.skipped_steps, engine.global_steps
    engine.destroy()
    return out


def all_cases(skip_cases: list[tuple[Any, ...]], error_cases: list[tuple[str, int]]) -> Any:
    """Every case in one spawned world (process start-up dominates these tiny runs)."""
    return {
        "skip": {case: skip_case(*case) for case in skip_cases},
        "error": {case: error_case(*case) for case in error_cases},
    }
