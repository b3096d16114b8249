"""Ring attention in training through ``slipstream.initialize``: tiny HF LLaMA / Qwen2 (GQA)
and the reference GPT at SP=2 (``sequence_parallel_mode: "ring"``) equal one process in
losses and parameters after 3 SGD steps, with ZeRO 0-3, packed documents and a length that
is not a multiple of 2P (padded); one forked world for all of it."""

from __future__ import annotations

import pytest
import torch

from slipstream.sequence import shard_causal_lm_batch_ring
from tests.distributed.harness import run_world
from tests.distributed.parity import assert_same_training
from tests.sequence import _ring_workloads as w
from tests.sequence import _workloads as s

# (model, ZeRO stage, sequence length, packed)
HF_RUNS = [
    ("llama_gqa2", 0, 16, False),
    ("qwen2_kv1", 2, 16, True),  # 1 KV head; two documents per row
    ("llama_heads3", 3, 15, False),  # 3 heads over 2 ranks; 15 tokens padded to 16
]
GPT_STAGES = [1]
REFUSED = [
    ({}, "gpt_ulysses"),  # ring mode, GPT built for Ulysses
    ({"sequence_parallel_mode": "ulysses"}, "llama_heads3"),  # Ulysses cannot split 3 heads
]


@pytest.fixture(scope="module")
def world2():
    return run_world(w.training_world, 2, HF_RUNS, GPT_STAGES, REFUSED)


def test_hf_ring_sp2_matches_single_process(world2):
    """fp32: losses rtol 1e-5, parameters rtol 1e-5 / atol 2e-5; both ranks agree."""
    for run in HF_RUNS:
        got = world2[0]["hf"][run]
        ref = w.hf_reference_run(run[0], run[2], run[3])
        assert got["attn"].startswith("slipstream_ring_"), got["attn"]
        assert got["shapes"] == [(4, 8)], got["shapes"]
        assert_same_training(got, ref, f"ring SP=2 {run}", param_rtol=1e-5, param_atol=2e-5)
        assert world2[1]["hf"][run]["losses"] == got["losses"], run


def test_gpt_ring_sp2_matches_single_process(world2):
    for stage in GPT_STAGES:
        ref = s.reference_run("gpt", 4)
        got = world2[0]["gpt"][stage]
        ref = {"losses": ref["losses"][: len(got["losses"])], "params": ref["params"]}
        assert_same_training(got, ref, f"GPT ring ZeRO-{stage}", param_rtol=1e-5, param_atol=2e-5)


def test_refusals_name_the_fix(world2):
    refused = world2[0]["refused"]
    msg = refused[str(REFUSED[0])]
    assert "sequence_parallel='ring'" in msg, msg
    msg = refused[str(REFUSED[1])]
    assert "num_attention_heads=3" in msg, msg


def test_ring_batch_cut_pads_and_keeps_documents():
    """Labels shifted on the full sequence, then padded (id 0, label -100, positions
    continuing) to the next multiple of 2P, then cut zig-zag."""
    ids = torch.arange(1, 7).view(1, 6)
    pos = torch.tensor([[0, 1, 2, 0, 1, 2]])
    batch = {"input_ids": ids, "labels": ids.clone(), "position_ids": pos}
    r0, r1 = (shard_causal_lm_batch_ring(batch, 2, r) for r in (0, 1))
    assert r0["input_ids"].tolist() == [[1, 2, 0, 0]] and r1["input_ids"].tolist() == [[3, 4, 5, 6]]
    assert r0["shift_labels"].tolist() == [[2, 3, -100, -100]]
    assert r1["shift_labels"].tolist() == [[4, 5, 6, -100]]
    assert r0["position_ids"].tolist() == [[0, 1, 3, 4]]
    with pytest.raises(ValueError, match="attention_mask has padding"):
        shard_causal_lm_batch_ring(dict(batch, attention_mask=torch.zeros(1, 6)), 2, 0)
