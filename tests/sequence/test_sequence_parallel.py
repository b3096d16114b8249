"""Ulysses and LSS attention, the sequence-parallel loss and SP x ZeRO training match one process."""

from __future__ import annotations

import pytest
import torch

from slipstream.sequence import check_heads, shard_sequence
from tests.distributed.harness import run_world
from tests.distributed.parity import assert_same_training
from tests.sequence import _workloads as w

# (method, causal, heads, kv heads); at P=2 kv=1 exercises KV replication (kv < P).
CASES2 = [
    (m, c, h, kv)
    for m in ("ulysses", "lss")
    for c in (True, False)
    for h, kv in ((4, 4), (4, 2), (4, 1))
] + [("deepspeed", True, 4, 2)]
CASES4 = [(m, True, h, kv) for m in ("ulysses", "lss") for h, kv in ((8, 8), (8, 2), (4, 4))]
# (model, attention, ZeRO stage, sp, global batch)
RUNS2 = [
    ("gpt", "ulysses", 0, 2, 4),
    ("gpt", "ulysses", 3, 2, 4),
    ("gpt", "lss", 2, 2, 4),
    ("posemb", "lss", 3, 2, 4),
    ("posemb", "ulysses", 1, 2, 4),
]
RUNS4 = [("gpt", "ulysses", 3, 2, 4), ("posemb", "lss", 0, 2, 4)]


@pytest.fixture(scope="module")
def world2():
    return run_world(w.world2, 2, CASES2, RUNS2)


@pytest.fixture(scope="module")
def world4():
    return run_world(w.world4, 4, CASES4, RUNS4)


@pytest.fixture(scope="module")
def references():
    return {(k, b): w.reference_run(k, b) for k in ("gpt", "posemb") for b in (4,)}


def _check_attention(per_rank, cases, world):
    for rank, result in enumerate(per_rank):
        for case in cases:
            got, ref = result["attention"][case]["got"], result["attention"][case]["ref"]
            for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref):
                torch.testing.assert_close(
                    g,
                    r,
                    rtol=1e-5,
                    atol=1e-6,
                    msg=lambda m, where=(rank, case, name): f"P={world} {where}: {m}",
                )


def test_attention_matches_single_process_p2(world2):
    """P=2: outputs and dQ/dK/dV of Ulysses, LSS and DistributedAttention equal SDPA's slices."""
    _check_attention(world2, CASES2, 2)


def test_attention_matches_single_process_p4(world4):
    """P=4: the same, with GQA split (kv=8, 2) and KV replication-free MHA."""
    _check_attention(world4, CASES4, 4)


def test_collectives_per_layer(world2):
    """Ulysses: 4 all-to-alls each way of (S/P) b h elements; LSS: 1 all-gather + 1 reduce-scatter."""
    stats = world2[0]["comm"]
    shard = 2 * 8 * 4 * 8 * 4  # b * S/P * H * D * fp32 bytes
    assert stats["ulysses"] == {"all_to_all": (8, 8 * shard)}, stats
    kv_full = 2 * shard * 2  # cat(k, v) gathered over P=2
    assert stats["lss"]["all_gather"] == (1, kv_full), stats
    assert stats["lss"]["reduce_scatter"] == (1, kv_full), stats
    assert set(stats["lss"]) == {"all_gather", "reduce_scatter"}, stats


def _check_training(per_rank, runs, references, world):
    for run in runs:
        kind, _, _, sp, batch = run
        got, ref = per_rank[0]["training"][run], references[(kind, batch)]
        assert got["shapes"] == [(batch * sp // world, w.SEQ // sp)], got["shapes"]
        assert got["params"].keys() == ref["params"].keys(), run
        assert_same_training(got, ref, f"world {world} {run}", param_rtol=1e-5, param_atol=2e-5)
        for other in per_rank[1:]:
            for name, p in got["params"].items():
                assert torch.equal(p, other["training"][run]["params"][name]), (run, name)


def test_training_sp2_matches_single_process(world2, references):
    """SP=2, ZeRO 0-3, GPT (RoPE offsets) and a learned-position-embedding LM: same losses/params."""
    _check_training(world2, RUNS2, references, 2)


def test_training_dp2_sp2_matches_single_process(world4, references):
    """DP=2 x SP=2 with ZeRO-3 (and stage 0 LSS): same losses and parameters as one process."""
    _check_training(world4, RUNS4, references, 4)


def test_lss_double_averaging_and_the_position_embedding_trap(world4):
    """Sharded PE rows + double averaging equal single-process gradients; the naive rule is N x."""
    for rank, result in enumerate(world4):
        ref, double = result["double"]["ref"], result["double"]["results"]["double"]
        naive = result["double"]["results"]["naive"]
        for name, g in ref.items():
            torch.testing.assert_close(double[name], g, rtol=1e-5, atol=1e-7, msg=f"{rank} {name}")
        torch.testing.assert_close(naive["pos"], 2 * ref["pos"], rtol=1e-5, atol=1e-7)


def test_head_errors_name_the_shapes():
    """Heads that cannot be split over the sp ranks give an error naming the counts and a fix."""
    with pytest.raises(ValueError, match=r"num_heads=6 is not divisible by sp=4.*LSS attention"):
        check_heads(6, 6, 4)
    with pytest.raises(
        ValueError,
        match=r"num_kv_heads % sp == 0 or sp % num_kv_heads == 0; got num_kv_heads=3, sp=2",
    ):
        check_heads(6, 3, 2)
    check_heads(8, 2, 4)
    check_heads(8, 1, 8)


def test_shard_sequence_slices_and_rejects_uneven_lengths():
    """Each sp rank gets its contiguous slice; per-sample scalars stay whole; odd lengths fail."""
    batch = {"ids": torch.arange(12).view(2, 6), "n": torch.tensor([1, 2])}
    part = shard_sequence(batch, 3, 1)
    assert part["ids"].tolist() == [[2, 3], [8, 9]] and part["n"].tolist() == [1, 2]
    with pytest.raises(
        ValueError, match=r"shape \(2, 6\) has length 6 along dim 1, not divisible by sp=4"
    ):
        shard_sequence(batch, 4, 0)
