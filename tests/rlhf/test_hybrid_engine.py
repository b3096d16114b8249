"""Hybrid engine on 2 gloo ranks: ZeRO-3 generation equals the unsharded model's greedy
tokens, gathers once per call (pinned) or per layer and token (unpinned, ranks in lock-step),
and a generate/train round trip leaves training untouched."""

from __future__ import annotations

import pytest
import torch

from tests.rlhf._hybrid_workloads import result


@pytest.mark.rlhf_checks("gen3")
def test_generation_equals_the_unsharded_model_token_for_token(rlhf_world):
    """ZeRO-3: engine.generate, engine.module.generate (DeepSpeed-Chat's call) and the
    unpinned per-layer path all give the unsharded model's greedy tokens (slipstream's
    decode loop and HF generate); each rank generates its own prompts and lengths. (ZeRO 0-2
    hold whole parameters: generation runs directly, as the DPO/PPO checks use it.)"""
    for g in result(rlhf_world, "gen3"):
        assert torch.equal(g["want"], g["hf_want"])
        for key in ("pinned", "module_generate", "unpinned"):
            assert torch.equal(g[key], g["want"]), key


@pytest.mark.rlhf_checks("gen3")
def test_pinned_generation_gathers_once_per_call(rlhf_world):
    """Pinned: one gather (plus its unit check) per unit for the whole call, 4 units
    (root + 3 layers) -> 8 all-gathers whatever the length; unpinned: every model call
    re-gathers every unit, and both ranks make the same number of calls (rank 0 wants 6
    tokens, rank 1 wants 10: rank 0 keeps pace) -> 10 forwards x 8."""
    for g in result(rlhf_world, "gen3"):
        assert g["pinned_gathers"] == 8
        assert g["unpinned_gathers"] == 80


@pytest.mark.rlhf_checks("gen3")
def test_training_layout_is_back_after_generation(rlhf_world):
    """After engine.train() every partitioned parameter is released again (1/N shard)."""
    for g in result(rlhf_world, "gen3"):
        assert g["shards_after"] == g["shards_before"] and sum(g["shards_after"]) == 0
        assert g["stats"].calls == 2 and g["stats"].new_tokens > 0
        assert g["stats"].paged_calls == 2  # pinned: the continuous-batching engine


@pytest.mark.rlhf_checks("trip3")
def test_round_trips_leave_the_next_training_step_unchanged(rlhf_world):
    """ZeRO-3, 5 eval/generate/train cycles between two steps: same parameters as without
    them, and the shard layout after each cycle is the training layout (nothing stays
    gathered)."""
    for t in result(rlhf_world, "trip3"):
        assert all(layout == t["reference_layout"] for layout in t["layouts"])
        assert set(t["plain"]) == set(t["cycled"])
        for name, p in t["plain"].items():
            assert torch.equal(p, t["cycled"][name]), name


@pytest.mark.rlhf_checks("refusals")
def test_models_and_layouts_it_cannot_serve_are_refused_at_initialize(rlhf_world):
    for errors in result(rlhf_world, "refusals"):
        assert "the model is a Linear, not a causal language model" in errors["not_causal"]
        assert "tensor_parallel.autotp_size=2" in errors["tp"]


@pytest.mark.rlhf_checks("tp_gen")
def test_tensor_parallel_generation_equals_the_unsharded_model_token_for_token(rlhf_world):
    """inference_tp_size 2 at world 2: both ranks form one TP group and decode the two
    ranks' prompts together (different widths, counts and contents per rank; rank 0 wants
    6 tokens, rank 1 wants 10, so the group decodes 10 steps, each agreed by one broadcast).
    Each rank gets exactly its own rows as the unsharded model generates them: the LLaMA at
    ZeRO-3 (one layer gathered at a time) and ZeRO-1, the reference GPT at ZeRO-3 (two
    layers at a time), the LLaMA with LoRA adapters (nonzero B) at ZeRO-3, fused into the
    TP copy; with EOS tokens that end rank 0's rows early, rank 0's answer stops
    there while the group decodes on for rank 1."""
    for rank, g in enumerate(result(rlhf_world, "tp_gen")):
        for case in ("llama3", "llama1", "gpt3", "lora3"):
            assert g[case]["got"].shape[0] == 2 + rank, case
            assert torch.equal(g[case]["got"], g[case]["want"]), case
            assert g[case]["steps"] == 10, case
            assert g[case]["after"] == g[case]["before"], case  # training shards untouched
            assert g[case]["stats"].calls == (2 if case == "llama3" else 1), case
        # Layers whole at each gather of the build: the rest of the model first, then
        # tp_gather_partition_size layers at a time (1 for the LLaMA, 2 for the GPT).
        assert g["llama3"]["gathered"] == [[], [0], [1], [2]]
        assert g["gpt3"]["gathered"] == [[], [0, 1], [2]]
        assert g["llama1"]["gathered"] == []  # ZeRO-1: whole parameters, nothing gathered
        assert torch.equal(g["eos"]["got"], g["eos"]["want"])
    rank0_eos = result(rlhf_world, "tp_gen")[0]["eos"]["got"]
    assert rank0_eos.shape[1] < 5 + 6  # stopped early although the group went on


@pytest.mark.rlhf_checks("paged_rollouts")
def test_unpinned_and_tensor_parallel_rollouts_run_on_the_paged_engine(rlhf_world):
    """Unpinned ZeRO-3 and inference_tp_size 2 decode on the continuous-batching engine:
    ragged rows per rank (2 prompts and 6 new tokens on rank 0, 3 prompts and 10 on rank 1,
    EOS ending rank 0's rows early, two copies per prompt) give the static loop's and the
    unsharded model's greedy tokens, each rank exactly its own rows; every KV block is free
    after each call; sampling is reproducible for a seed. Unpinned: both ranks make the
    same gathers, one per unit (4 units, 2 all-gathers each) per forward of the rank that
    decoded longest, so rank 0 kept pace after its rows ended. TP: one token broadcast per
    forward, the same forwards on both ranks."""
    ranks = result(rlhf_world, "paged_rollouts")
    for rank, r in enumerate(ranks):
        for case in ("z3", "tp"):
            c = r[case]
            assert c["paged"].shape[0] == 2 * (2 + rank), case
            assert torch.equal(c["paged"], r["want"]), case
            assert torch.equal(c["static"], r["want"]), case
            assert torch.equal(c["draws"][0], c["draws"][1]), case
            assert c["draws"][0].shape[1] > 5 + rank, case  # new tokens after the prompt
            assert c["blocks"] and all(free == total for free, total in c["blocks"]), case
            assert (c["stats"].calls, c["stats"].paged_calls) == (4, 3), case
        assert r["want"].shape[1] < 5 + 6 or rank == 1  # EOS ended rank 0's rows early
    z3 = [r["z3"] for r in ranks]
    assert z3[0]["forwards"] < z3[1]["forwards"]
    assert z3[0]["gathers"] == z3[1]["gathers"] == 8 * z3[1]["forwards"]
    tp = [r["tp"] for r in ranks]
    assert tp[0]["forwards"] == tp[1]["forwards"] == tp[0]["broadcasts"] == tp[1]["broadcasts"]


@pytest.mark.rlhf_checks("tp_trip")
def test_tensor_parallel_round_trips_leave_the_next_training_step_unchanged(rlhf_world):
    """ZeRO-3, inference_tp_size 2: 3 eval/generate/train cycles between two steps give
    the same parameters as no cycles."""
    for t in result(rlhf_world, "tp_trip"):
        assert set(t["plain"]) == set(t["cycled"])
        for name, p in t["plain"].items():
            assert torch.equal(p, t["cycled"][name]), name


@pytest.mark.rlhf_checks("tp_refusals")
def test_inference_tp_size_not_dividing_the_world_or_heads_is_refused(rlhf_world):
    """At initialize: T not dividing the world or the heads, a model whose class cannot
    rebuild it (an added layer). At generate, on both ranks before any gather: a request
    only rank 1 gets wrong (rank 0 names rank 1), and one that only the joint batch breaks
    (rank 0: 30-token prompt + 2, rank 1: 5 + 20, joint 30 + 20 > max_out_tokens 40)."""
    for rank, errors in enumerate(result(rlhf_world, "tp_refusals")):
        assert "inference_tp_size=3 does not divide the world size 2" in errors["world"]
        heads = errors["heads"]
        assert "inference_tp_size=2 does not divide the model's num_attention_heads=3" in heads
        assert "training module has 'model.layers.0.mlp.extra." in errors["adapted"]
        assert "-1 new tokens requested" in errors["one_rank"]
        assert errors["one_rank"].startswith("hybrid engine: rank 1: ") == (rank == 0)
        assert "50 > hybrid_engine.max_out_tokens=40" in errors["joint_length"]


def test_hybrid_engine_block_is_parsed_and_unsupported_options_refused():
    """DeepSpeed's keys and defaults are accepted (inference_tp_size is checked against the
    world and the model when the engine is built); a typo is an unknown-key error."""
    from slipstream.config import ConfigError, parse_config

    base = {"train_batch_size": 1}
    block = parse_config({**base, "hybrid_engine": {"enabled": True}}).hybrid_engine
    assert (block.max_out_tokens, block.inference_tp_size, block.pin_parameters) == (512, 1, True)
    assert (block.release_inference_cache, block.tp_gather_partition_size) == (False, 8)
    tp = {"enabled": True, "inference_tp_size": 2, "tp_gather_partition_size": 1}
    block = parse_config({**base, "hybrid_engine": tp}).hybrid_engine
    assert (block.inference_tp_size, block.tp_gather_partition_size) == (2, 1)
    with pytest.raises(ConfigError, match="inference_tp_size"):
        parse_config({**base, "hybrid_engine": {"enabled": True, "inference_tp_size": 0}})
    with pytest.raises(ConfigError, match="pin_paramters"):
        parse_config({**base, "hybrid_engine": {"enabled": True, "pin_paramters": False}})
