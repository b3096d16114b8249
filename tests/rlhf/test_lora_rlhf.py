"""LoRA on RLHF models at 2 gloo ranks (DeepSpeed-Chat's --actor_lora_dim / --only_optimize_lora):
the hybrid engine generates with the adapters fused and gives the unfused model's tokens,
round trips leave the weights bit-for-bit, only the adapters get optimizer state, and a PPO
step trains only the adapters with host-resident reference and reward models."""

from __future__ import annotations

import math

import pytest
import torch

from tests.rlhf._hybrid_workloads import result


@pytest.mark.rlhf_checks("lora_gen")
def test_fused_generation_equals_the_unfused_model_token_for_token(rlhf_world):
    """ZeRO-3 pinned: every decode-step forward runs with the adapters fused, and the tokens
    are those of the unsharded model running x W^T + s x A^T B^T (which differ from the model
    without adapters, so the adapters count); unpinned runs them unfused, same tokens; after
    generate nothing stays fused and no kept copy lingers."""
    for g in result(rlhf_world, "lora_gen"):
        assert not torch.equal(g["want"], g["no_lora"])
        assert torch.equal(g["pinned"], g["want"])
        assert torch.equal(g["unpinned"], g["want"])
        assert g["pinned_fused"] and all(g["pinned_fused"])
        assert g["unpinned_fused"] and not any(g["unpinned_fused"])
        assert g["unfused_after"]


@pytest.mark.rlhf_checks("lora_gen")
def test_only_lora_parameters_get_optimizer_state(rlhf_world):
    """only_optimize_lora: the optimizer trains exactly the adapter matrices, and its AdamW
    state (exp_avg, exp_avg_sq) covers this rank's half of them, nothing of the base."""
    for g in result(rlhf_world, "lora_gen"):
        assert g["trained"] == g["lora_names"] and len(g["trained"]) == 3 * 7 * 2
        assert g["state_numel"] == 2 * g["lora_numel"] // 2


@pytest.mark.parametrize(
    "check",
    [
        pytest.param(name, marks=pytest.mark.rlhf_checks(name))
        for name in ("lora_trip3", "lora_trip3_full", "lora_trip2")
    ],
)
def test_generate_train_round_trips_leave_parameters_unchanged(rlhf_world, check):
    """3 fused eval/generate/train cycles between two training steps give the parameters of
    a run without them, bit for bit: ZeRO-3 with frozen (replicated) base weights, ZeRO-3
    training everything with small units persistent, and ZeRO-2."""
    for t in result(rlhf_world, check):
        assert t["fused"] and any(t["fused"])  # the cycles did fuse
        assert set(t["plain"]) == set(t["cycled"])
        for name, p in t["plain"].items():
            assert torch.equal(p, t["cycled"][name]), name


@pytest.mark.rlhf_checks("lora_ppo")
def test_ppo_with_lora_actor_and_critic_and_offloaded_frozen_models(rlhf_world):
    """Two PPO steps: the critic trains its adapters and v_head only; the actor's adapters
    move while its base weights and the reference stay bit-for-bit; the reference and the
    reward model stream their 6 units (3 blocks, embedding, norm, head) once per step's
    forward: 12 fetches each; metrics are finite."""
    for p in result(rlhf_world, "lora_ppo"):
        assert p["trained_critic"][-1] == "v_head.weight"
        assert all(n.endswith(("lora_a", "lora_b")) for n in p["trained_critic"][:-1])
        assert p["lora_moved"] > 0 and p["base_kept"] and p["reference_kept"] and p["unfused"]
        assert p["fetches"] == [12, 12]
        for m in p["metrics"]:
            assert m is not None and math.isfinite(m.actor_loss) and math.isfinite(m.kl)


def test_chat_step3_with_lora_and_offload_saves_merged_plain_models(tmp_path):
    """``slipstream chat`` with --actor-lora-dim/--critic-lora-dim 4, --only-optimize-lora and
    both --offload-* flags: PPO runs, and the saved actor and critic are plain models (the
    adapters merged into the converted weights, no lora_a/lora_b keys) whose converted
    weights moved while everything else (embeddings, norms, the actor's head) is unchanged;
    the critic's v_head is trained too."""
    from tests.distributed.harness import run_world
    from tests.rlhf._lora_workloads import chat_step3_with_lora

    r = run_world(chat_step3_with_lora, 1, str(tmp_path), timeout_s=240)[0]
    assert r["ppo_rows"] == 4 and math.isfinite(r["summary"]["step3_kl"])
    for saved, start in ((r["actor"], r["sft"]), (r["critic"], r["rm"])):
        assert set(saved) == set(start)  # no adapter keys: a plain model
        converted = {k for k in start if k.startswith(("layers.", "backbone.layers."))
                     and k.endswith("proj.weight")}  # fmt: skip
        assert converted and all(not torch.equal(saved[k], start[k]) for k in converted)
        kept = set(start) - converted - {"v_head.weight"}
        assert kept and all(torch.equal(saved[k], start[k]) for k in kept)
    assert not torch.equal(r["critic"]["v_head.weight"], r["rm"]["v_head.weight"])
