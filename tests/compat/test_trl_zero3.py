"""What TRL and Accelerate reach into on a ZeRO-3 engine works on slipstream's (2 ranks,
``SLIPSTREAM_AS_DEEPSPEED=1``): TRL's ``unwrap_model_for_generation`` gathers the model, takes
the hooks off and puts them back (``optimizer.parameter_offload``), greedy generation inside
gives the unpartitioned model's tokens and training continues with its loss; and
``deepspeed.runtime.zero.linear``'s module trains at ZeRO-3 as ``nn.Linear`` in one process."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from typing import Any

import pytest

from tests.compat import _trl_workloads as w
from tests.distributed.harness import run_world

HAS_TRL = all(importlib.util.find_spec(m) for m in ("transformers", "accelerate", "trl"))
needs_trl = pytest.mark.skipif(not HAS_TRL, reason="needs transformers, accelerate and trl")


@pytest.fixture(scope="module")
def results() -> Iterator[list[dict[str, Any]]]:
    old = os.environ.pop("SLIPSTREAM_AS_DEEPSPEED", None)
    os.environ["SLIPSTREAM_AS_DEEPSPEED"] = "1"  # Accelerate and TRL import `deepspeed`
    try:
        yield run_world(w.all_cases, 2, HAS_TRL, timeout_s=400)
    finally:
        os.environ.pop("SLIPSTREAM_AS_DEEPSPEED")
        if old is not None:
            os.environ["SLIPSTREAM_AS_DEEPSPEED"] = old


@needs_trl
def test_unwrap_model_for_generation_gives_the_unpartitioned_tokens(
    results: list[dict[str, Any]],
) -> None:
    for rank in results:
        trl = rank["trl"]
        assert trl["got"] == trl["expected"]
        assert trl["got_ungathered"] == trl["expected"]  # gather_deepspeed3_params=False
        before, inside, after = trl["hooks"]
        assert before > 0 and inside == 0 and after == before
        assert trl["released"] == (True, True, True)


@needs_trl
def test_training_continues_after_unwrap(results: list[dict[str, Any]]) -> None:
    for rank in results:
        ours, reference = rank["trl"]["loss"]
        assert abs(ours - reference) <= 1e-5 * abs(reference)


def test_zero3_linear_module_trains_as_nn_linear(results: list[dict[str, Any]]) -> None:
    for rank in results:
        linear = rank["linear"]
        for ours, ref in zip(linear["losses"], linear["reference"], strict=True):
            assert abs(ours - ref) <= 1e-5 * max(1.0, abs(ref))


def test_zero3_linear_gathers_a_released_weight_for_backward(
    results: list[dict[str, Any]],
) -> None:
    for rank in results:
        case = rank["linear"]["released_weight"]
        assert case["released"]  # the weight was released when its backward ran
        assert case["input_grad"] <= 1e-6 and case["weight"] <= 1e-6
