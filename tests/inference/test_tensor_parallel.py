"""Tensor-parallel inference: TP=2 (two gloo processes) generates what TP=1 generates."""

from __future__ import annotations

import pytest

from slipstream.inference import init_inference
from tests.distributed.harness import run_world
from tests.inference import _tp_workloads as w


@pytest.fixture(scope="module")
def tp2():
    return run_world(w.tp_generation, 2, timeout_s=180)


@pytest.mark.parametrize("name", sorted(w.MODELS))
def test_tp2_equals_tp1_and_ranks_agree(tp2, name):
    ref = w.generations(init_inference(w.MODELS[name]()))
    full_heads = 64  # q_proj output rows of both tiny models
    for rank, res in enumerate(tp2):
        got = res[name]
        assert got["local_heads"] == full_heads // 2, "the model was not split"
        assert got["greedy"].equal(ref["greedy"]), (rank, got["greedy"], ref["greedy"])
        # The same seed draws the same tokens at TP=2 as at TP=1, on every rank.
        assert got["sampled"].equal(ref["sampled"]), (rank, got["sampled"], ref["sampled"])
        assert got["sampled_again"].equal(got["sampled"])
        assert got["generator"].equal(ref["generator"])
    assert not ref["sampled"].equal(ref["greedy"]), "sampling should differ from greedy"
    assert tp2[0][name]["unseeded"].equal(tp2[1][name]["unseeded"])


def test_ranks_asking_for_different_prompts_fail_together(tp2):
    for res in tp2:
        assert res["mismatch"] is not None and "differs between ranks" in res["mismatch"]
