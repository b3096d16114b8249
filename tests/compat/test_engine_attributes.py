"""DeepSpeed's engine attributes: look-ups fall through to the model; tput_timer, world and
model-parallel sizes, the data-parallel group, steps_per_print, save_fp16_model and
empty_partition_cache act as DeepSpeed's (world 2, stages 1 and 3)."""

from __future__ import annotations

import math

import pytest

from tests.compat import _engine_workloads as w
from tests.distributed.harness import run_world


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_world(w.attributes, 2, timeout_s=180)


def test_attribute_fall_through_and_sizes(results: list[dict]) -> None:
    for r in results:
        for stage, got in r.items():
            assert got["tag"] == "mine" and got["describe"] == "tagged mine"
            assert "no attribute 'no_such_thing'" in got["missing"]
            assert "neither has the wrapped module (Tagged)" in got["missing"]
            assert (got["world_size"], got["mp_world_size"], got["dp_group_size"]) == (2, 1, 2)
            assert got["partition_gradients"] == (stage >= 2)
            assert got["steps_per_print"] == (3 if stage == 3 else 10)
            assert got["wall_clock_breakdown"] is False


def test_throughput_timer_skips_two_warmup_steps(results: list[dict]) -> None:
    rates = results[0][1]["rates"]
    assert rates[:2] == [-math.inf, -math.inf]
    assert all(rate > 0 for rate in rates[2:])


def test_save_fp16_model_and_empty_partition_cache(results: list[dict]) -> None:
    for r in results:
        for stage, got in r.items():
            assert got["saved"] is True and any(f.endswith(".safetensors") for f in got["files"])
            if stage == 3:  # gathered units are released; stages 0-2 keep whole weights
                assert got["gathered"] and got["released"]
            else:
                assert not got["released"]
