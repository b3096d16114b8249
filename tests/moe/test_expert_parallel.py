"""Expert parallelism on 2 gloo ranks equals one process holding every expert (fp32, no
drops): forward, gradients, the global gradient norm and three optimizer steps, with uneven
routing across ranks and an expert that receives no token; through the engine at ZeRO stages
0-3 (and bf16), ep_size 2 equals ep_size 1."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.distributed.harness import run_world
from tests.moe import _ep_workloads as w

TOL = {"rtol": 1e-5, "atol": 1e-6}


@pytest.mark.parametrize("k", [1, 2])
def test_ep2_equals_one_process(k: int) -> None:
    """Forward, reduced gradients, clipped norm and parameters after 3 steps match."""
    ranks = run_world(w.manual_ep, 2, k, 0.1)
    for rank, res in enumerate(ranks):
        ref = res["reference"]
        view = res["reference_view"]
        for step in range(w.STEPS):
            torch.testing.assert_close(res["outs"][step], ref["outs"][step][rank], **TOL)
            assert res["grads"][step].keys() == view["grads"][step].keys()
            for name, g in res["grads"][step].items():
                torch.testing.assert_close(g, view["grads"][step][name], **TOL)
            assert res["norms"][step] == pytest.approx(ref["norms"][step], rel=1e-5)
        for name, p in res["params"].items():
            torch.testing.assert_close(p, view["params"][name], **TOL)
    # The routing was uneven across ranks and expert 3 got nothing, on every rank.
    c0, c1 = ranks[0]["counts"][0], ranks[1]["counts"][0]
    assert not torch.equal(c0, c1)
    assert int(c0[3]) == int(c1[3]) == 0
    # Clipping took effect (the norm is above the 0.1 limit).
    assert ranks[0]["norms"][0] > 0.1


def _check_engine(res: dict[str, Any], tol: dict[str, float]) -> None:
    ep1, ep2 = res[1], res[2]
    # ep_size 2 on 2 ranks: the experts have buckets of their own, over a 1-rank edp group.
    assert ep2["expert_buckets"] and set(ep2["expert_buckets"]) == {1}
    assert not ep1["expert_buckets"]
    for a, b in zip(ep1["losses"], ep2["losses"], strict=True):
        assert a == pytest.approx(b, rel=tol["rtol"] * 10, abs=tol["atol"] * 10)
    for name, p in ep2["params"].items():
        torch.testing.assert_close(p, res["reference"][name], **tol)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_engine_ep2_equals_ep1_fp32(stage: int) -> None:
    """slipstream.initialize: expert buckets over the expert-data-parallel group, clipping
    over the true global norm; parameters equal the one-process reference. At stage 3 the
    expert parameters are partitioned over their expert-data-parallel group, the dense ones
    over the data-parallel group."""
    for res in run_world(w.engine_ep, 2, stage, False, 0.1):
        _check_engine(res, TOL)


def test_engine_ep2_bf16() -> None:
    """bf16 with fp32 master weights: ep_size 2 stays within bf16 rounding of the reference."""
    for res in run_world(w.engine_ep, 2, 2, True, 0.1):
        _check_engine(res, {"rtol": 2e-2, "atol": 2e-2})
