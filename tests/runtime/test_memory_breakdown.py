"""``memory_breakdown``: every step line carries this rank's memory at the phase boundaries
and its model-state bytes, which equal the ZeRO estimator's for a plain fp32 Adam layout."""

from __future__ import annotations

import re
from typing import Any

import torch

from tests.distributed.harness import run_world


def _train(stage: int) -> dict[str, Any]:
    import logging

    import slipstream
    from slipstream.models import GPT, GPTConfig

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler = Keep()
    logging.getLogger("slipstream").addHandler(handler)
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny"))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage},
        "memory_breakdown": True,
        "steps_per_print": 2,
    }
    engine, opt, *_ = slipstream.initialize(model=model, config=config)
    for _ in range(4):
        t = torch.randint(0, 256, (2, 17))
        loss = engine(t[:, :-1], t[:, 1:])
        engine.backward(loss)
        engine.step()
    held = opt.memory_bytes()
    engine.destroy()
    logging.getLogger("slipstream").removeHandler(handler)
    return {"lines": [x for x in lines if "memory " in x], "held": held}


def _train_stages() -> dict[int, dict[str, Any]]:
    return {stage: _train(stage) for stage in (2, 3)}


def test_memory_breakdown_stages_2_and_3() -> None:
    ranks = run_world(_train_stages, 2)
    for stage in (2, 3):
        _check(ranks[0][stage], ranks[1][stage])


def _check(rank0: dict[str, Any], rank1: dict[str, Any]) -> None:
    assert rank1["lines"] == []  # rank 0 logs
    lines = rank0["lines"]
    assert len(lines) == 2, lines
    for phase in ("forward", "backward", "step"):
        assert re.search(rf"{phase}: rss [\d.]+ MB", lines[-1]), lines[-1]
    held, estimate = re.search(r"= ([\d.]+) MB \(ZeRO estimator: ([\d.]+) MB\)", lines[-1]).groups()
    # fp32 Adam: parameters, fp32 gradient accumulators, no separate master, 2 states; the
    # estimator counts the same, up to the flat buckets' padding to a multiple of the world.
    assert abs(float(held) - float(estimate)) <= 0.01 * float(estimate), (held, estimate)
    assert rank0["held"]["master"] == 0 and rank0["held"]["optimizer"] > 0
