"""RLHF on slipstream: DeepSpeed-Chat's losses and estimators, the hybrid engine, GRPO.

``slipstream.rlhf.losses`` and ``slipstream.rlhf.advantages`` are pure functions on tensors
(reward-model loss, KL-shaped rewards, GAE, PPO actor/critic losses, GRPO/RLOO advantages,
DPO). See docs/rlhf.md.
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
from slipstream.rlhf.grpo import GRPOConfig, GRPOMetrics, GRPOTrainer, completion_mask
from slipstream.rlhf.hybrid import GenerationStats, HybridEngine, enable_hybrid_engine_
from slipstream.rlhf.losses import (
    DPOOutput,
    RewardModelOutput,
    dpo_loss,
    ppo_actor_loss,
    ppo_critic_loss,
    reward_model_loss,
    token_logprobs,
)

__all__ = [
    "DPOOutput",
    "GRPOConfig",
    "GRPOMetrics",
    "GRPOTrainer",
    "GenerationStats",
    "HybridEngine",
    "RewardModelOutput",
    "completion_mask",
    "dpo_loss",
    "ema_update_",
    "enable_hybrid_engine_",
    "gae_advantages_and_returns",
    "grpo_advantages",
    "k3_kl",
    "kl_shaped_rewards",
    "ppo_actor_loss",
    "ppo_critic_loss",
    "reward_model_loss",
    "rloo_advantages",
    "token_logprobs",
]
