"""The names this module held before DeepSpeed-Chat's three steps got a module each:
:mod:`.sft` (step 1), :mod:`.reward` (step 2), :mod:`.ppo` (step 3). Import from those."""

from __future__ import annotations

from slipstream.rlhf.ppo import Experience, PPOConfig, PPOMetrics, PPOTrainer
from slipstream.rlhf.reward import RewardModel, reward_step, sequence_scores
from slipstream.rlhf.sft import lm_batch_loss, sft_step

__all__ = [
    "Experience",
    "PPOConfig",
    "PPOMetrics",
    "PPOTrainer",
    "RewardModel",
    "lm_batch_loss",
    "reward_step",
    "sequence_scores",
    "sft_step",
]
