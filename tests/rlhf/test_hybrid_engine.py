"""Hybrid engine on 2 gloo ranks: ZeRO-3 generation equals the unsharded model's greedy
tokens, gathers once per call (pinned) or per layer and token (unpinned, ranks in lock-step),
and a generate/train round trip leaves training untouched."""

from __future__ import annotations

import pytest
import torch

from tests.rlhf._hybrid_workloads import result


def test_generation_equals_the_unsharded_model_token_for_token(rlhf_world):
    """ZeRO-3: engine.generate, engine.module.generate (DeepSpeed-Chat's call) and the
    unpinned per-layer path all give the unsharded model's greedy tokens (slipstream's
    decode loop and HF generate); each rank generates its own prompts and lengths. (ZeRO 0-2
    hold whole parameters: generation runs directly, as the DPO/PPO checks use it.)"""
    for g in result(rlhf_world, "gen3"):
        assert torch.equal(g["want"], g["hf_want"])
        for key in ("pinned", "module_generate", "unpinned"):
            assert torch.equal(g[key], g["want"]), key


def test_pinned_generation_gathers_once_per_call(rlhf_world):
    """Pinned: one gather (plus its unit check) per unit for the whole call, 4 units
    (root + 3 layers) -> 8 all-gathers whatever the length; unpinned: every model call
    re-gathers every unit, and both ranks make the same number of calls (rank 0 wants 6
    tokens, rank 1 wants 10: rank 0 keeps pace) -> 10 forwards x 8."""
    for g in result(rlhf_world, "gen3"):
        assert g["pinned_gathers"] == 8
        assert g["unpinned_gathers"] == 80


def test_training_layout_is_back_after_generation(rlhf_world):
    """After engine.train() every partitioned parameter is released again (1/N shard)."""
    for g in result(rlhf_world, "gen3"):
        assert g["shards_after"] == g["shards_before"] and sum(g["shards_after"]) == 0
        assert g["stats"].calls == 2 and g["stats"].new_tokens > 0


def test_round_trips_leave_the_next_training_step_unchanged(rlhf_world):
    """ZeRO-3, 5 eval/generate/train cycles between two steps: same parameters as without
    them, and the shard layout after each cycle is the training layout (nothing stays
    gathered)."""
    for t in result(rlhf_world, "trip3"):
        assert all(layout == t["reference_layout"] for layout in t["layouts"])
        assert set(t["plain"]) == set(t["cycled"])
        for name, p in t["plain"].items():
            assert torch.equal(p, t["cycled"][name]), name


def test_models_and_layouts_it_cannot_serve_are_refused_at_initialize(rlhf_world):
    for errors in result(rlhf_world, "refusals"):
        assert "the model is a Linear, not a causal language model" in errors["not_causal"]
        assert "tensor_parallel.autotp_size=2" in errors["tp"]


def test_hybrid_engine_block_is_parsed_and_unsupported_options_refused():
    """DeepSpeed's keys and defaults are accepted; inference_tp_size > 1 is refused (not
    implemented), never ignored; a typo is an unknown-key error."""
    from slipstream.config import ConfigError, parse_config

    base = {"train_batch_size": 1}
    block = parse_config({**base, "hybrid_engine": {"enabled": True}}).hybrid_engine
    assert (block.max_out_tokens, block.inference_tp_size, block.pin_parameters) == (512, 1, True)
    assert (block.release_inference_cache, block.tp_gather_partition_size) == (False, 8)
    with pytest.raises(
        ConfigError, match=r"'hybrid_engine\.inference_tp_size' = 2 is not supported"
    ):
        parse_config({**base, "hybrid_engine": {"enabled": True, "inference_tp_size": 2}})
    with pytest.raises(ConfigError, match="pin_paramters"):
        parse_config({**base, "hybrid_engine": {"enabled": True, "pin_paramters": False}})
