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


@pytest.mark.parametrize("name", sorted(w.MODELS))
def test_tp2_greedy_runs_paged_with_the_static_loops_tokens(tp2, name):
    """``init_inference(tp_size=2).generate``: greedy requests run on the continuous-batching
    engine (every rank the same schedule, TP rank 0's tokens each step), with the tokens of
    the TP static loop and of the unsharded model (paged and static), every block free
    after, TP rank 0's tokens broadcast once per forward; rows that stop early at an EOS
    too."""
    ids, mask = w.left_padded(w.LENGTHS)
    kw = dict(attention_mask=mask, max_new_tokens=w.NEW)
    one = w.MODELS[name]()
    ref_static = init_inference(one, kv_cache="dynamic").generate(ids, **kw)
    ref_paged = init_inference(one).generate(ids, **kw)
    eos = tp2[0][name]["eos"]
    eos_kw = dict(kw, eos_token_id=eos, pad_token_id=w.PAD)
    ref_eos = init_inference(one, kv_cache="dynamic").generate(ids, **eos_kw)
    assert ref_static.equal(ref_paged)
    assert (ref_eos[:, ids.shape[1] :] == eos).any(1).sum() >= 1, "no row stopped early"
    assert ref_eos.shape[1] == ref_static.shape[1]
    for rank, res in enumerate(tp2):
        for key in ("paged_runs", "paged_eos_runs"):
            assert len(res[name][key]) == 1, (rank, key, "the paged engine did not run once")
            forwards, broadcasts, free, total = res[name][key][0]
            assert forwards > 0 and free == total, (rank, key, res[name][key])
            assert broadcasts == forwards, (rank, key, "one agree broadcast per forward")
        assert res[name]["paged"].equal(res[name]["static"]), rank
        assert res[name]["paged"].equal(ref_static), rank
        assert res[name]["eos"] == eos
        assert res[name]["paged_eos"].equal(res[name]["static_eos"]), rank
        assert res[name]["paged_eos"].equal(ref_eos), rank


def test_ranks_asking_for_different_prompts_fail_together(tp2):
    for res in tp2:
        assert res["mismatch"] is not None and "differs between ranks" in res["mismatch"]
