"""RLHF on slipstream: the hybrid engine, DeepSpeed-Chat's three steps (SFT, reward model,
PPO) and their data, LoRA and offload for its models, GRPO/RLOO, DPO, and the losses and estimators under them.

One module per algorithm (``sft``, ``reward``, ``ppo``, ``grpo``, ``dpo``; ``e2e`` chains
DeepSpeed-Chat's three steps for ``slipstream chat``), all scoring through ``policy`` (a
causal LM on a masked batch, per-token log-probabilities and entropy, sampling seeds, clip
statistics). ``slipstream.rlhf.losses`` and ``slipstream.rlhf.advantages`` are pure functions
on tensors (reward-model loss, KL-shaped rewards, GAE, PPO actor/critic losses, GRPO loss,
GRPO/RLOO advantages, DPO). See docs/rlhf.md.
"""

from __future__ import annotations

from slipstream.rlhf.advantages import (
    ema_update_,
    gae_advantages_and_returns,
    grpo_advantages,
    k3_kl,
    kl_shaped_rewards,
    rloo_advantages,
)
from slipstream.rlhf.data import (
    PairBatch,
    PreferenceRecord,
    PromptBatch,
    SFTBatch,
    apply_chat_template,
    check_same_tokenizer,
    load_preference_records,
    pair_batch,
    parse_data_split,
    prompt_batch,
    sft_batch,
    split_for_step,
    text_batch,
)
from slipstream.rlhf.dpo import DPOConfig, DPOMetrics, DPOTrainer
from slipstream.rlhf.grpo import GRPOConfig, GRPOMetrics, GRPOTrainer, completion_mask
from slipstream.rlhf.hybrid import GenerationStats, HybridEngine, enable_hybrid_engine_
from slipstream.rlhf.lora import LoRAPolicy, apply_lora_policy_, merge_lora_state_dict
from slipstream.rlhf.losses import (
    DPOOutput,
    GRPOLossOutput,
    RewardModelOutput,
    causal_lm_loss,
    dpo_loss,
    grpo_loss,
    ppo_actor_loss,
    ppo_critic_loss,
    reward_model_loss,
    token_logprobs,
)
from slipstream.rlhf.offload import HostOffload, offload_frozen_
from slipstream.rlhf.policy import entropy_from_logits, selective_log_softmax
from slipstream.rlhf.ppo import Experience, PPOConfig, PPOMetrics, PPOTrainer
from slipstream.rlhf.reward import RewardModel, reward_step, sequence_scores
from slipstream.rlhf.sft import lm_batch_loss, sft_step

__all__ = [
    "DPOConfig",
    "DPOMetrics",
    "DPOOutput",
    "DPOTrainer",
    "Experience",
    "GRPOConfig",
    "GRPOLossOutput",
    "GRPOMetrics",
    "GRPOTrainer",
    "GenerationStats",
    "HostOffload",
    "HybridEngine",
    "LoRAPolicy",
    "PPOConfig",
    "PPOMetrics",
    "PPOTrainer",
    "PairBatch",
    "PreferenceRecord",
    "PromptBatch",
    "RewardModel",
    "RewardModelOutput",
    "SFTBatch",
    "apply_chat_template",
    "apply_lora_policy_",
    "causal_lm_loss",
    "check_same_tokenizer",
    "completion_mask",
    "dpo_loss",
    "ema_update_",
    "enable_hybrid_engine_",
    "entropy_from_logits",
    "gae_advantages_and_returns",
    "grpo_advantages",
    "grpo_loss",
    "k3_kl",
    "kl_shaped_rewards",
    "lm_batch_loss",
    "load_preference_records",
    "merge_lora_state_dict",
    "offload_frozen_",
    "pair_batch",
    "parse_data_split",
    "ppo_actor_loss",
    "ppo_critic_loss",
    "prompt_batch",
    "reward_model_loss",
    "reward_step",
    "rloo_advantages",
    "selective_log_softmax",
    "sequence_scores",
    "sft_batch",
    "sft_step",
    "split_for_step",
    "text_batch",
    "token_logprobs",
]
