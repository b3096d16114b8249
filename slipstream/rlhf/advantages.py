"""Advantage estimators: DeepSpeed-Chat's KL-shaped rewards and GAE, and the critic-free
group estimators GRPO and RLOO.

Token-position convention (DeepSpeed-Chat step 3): sequences are ``[prompt (P, left-padded) |
answer]`` and per-token arrays (log-probabilities, values, rewards) have one entry per
predicted token, so position ``t`` scores token ``t + 1`` and the first answer token sits at
``start = P - 1``.
"""

from __future__ import annotations

import torch

__all__ = [
    "ema_update_",
    "gae_advantages_and_returns",
    "grpo_advantages",
    "k3_kl",
    "kl_shaped_rewards",
    "rloo_advantages",
]


def kl_shaped_rewards(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    reward_scores: torch.Tensor,
    action_mask: torch.Tensor,
    start: int,
    kl_coef: float = 0.1,
    clip_reward: float = 5.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards with the KL penalty folded in (DeepSpeed-Chat step 3, item 3).

    ``r_t = -kl_coef (logp_t - logp_ref_t)`` everywhere; ``end = start + n + 1`` with ``n``
    the valid answer tokens of the row (``action_mask[:, start:]``); the clipped score
    ``clip(R, +-clip_reward)`` is added at ``end - 1`` (at the last position when ``end``
    runs past the row, as DeepSpeed-Chat's slice does); then ``r_t = 0`` for ``t >= end``.

    Args:
        logprobs, ref_logprobs: ``[B, T]`` actor and reference log-probabilities.
        reward_scores: ``[B]`` the reward model's (or rule's) score of each sequence.
        action_mask: ``[B, T]`` 1 on answer tokens that are not padding.
        start: ``P - 1``, where the answer's first token is scored.
    Returns:
        ``(rewards [B, T], ends [B])``; callers zero the old values at ``t >= ends`` too.
    """
    rewards = -kl_coef * (logprobs - ref_logprobs)
    length = rewards.shape[1]
    ends = start + action_mask[:, start:].sum(1).long() + 1
    last = ends.clamp(max=length) - 1
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    rewards[rows, last] += reward_scores.to(rewards.dtype).clamp(-clip_reward, clip_reward)
    after_end = torch.arange(length, device=rewards.device).unsqueeze(0) >= ends.unsqueeze(1)
    return rewards.masked_fill(after_end, 0.0), ends


def gae_advantages_and_returns(
    values: torch.Tensor,
    rewards: torch.Tensor,
    start: int,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016, eq. 16) from ``start`` on.

    ``delta_t = r_t + gamma V_{t+1} - V_t`` (``V`` past the last position is 0),
    ``A_t = delta_t + gamma lam A_{t+1}``, ``G_t = A_t + V_t``. No whitening: DeepSpeed-Chat
    uses the advantages as they come. Returns ``(advantages, returns)``, each
    ``[B, T - start]`` and detached.
    """
    values, rewards = values.detach(), rewards.detach()
    next_values = torch.cat([values[:, 1:], values.new_zeros(values.shape[0], 1)], dim=1)
    deltas = rewards + gamma * next_values - values
    advantages = torch.zeros_like(deltas)
    running = deltas.new_zeros(deltas.shape[0])
    for t in range(deltas.shape[1] - 1, start - 1, -1):
        running = deltas[:, t] + gamma * lam * running
        advantages[:, t] = running
    advantages = advantages[:, start:]
    return advantages, advantages + values[:, start:]


def _grouped(rewards: torch.Tensor, group_size: int, name: str) -> torch.Tensor:
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(
            f"{name}: rewards must be 1-D with a length divisible by group_size={group_size} "
            f"(prompt-major: the {group_size} samples of prompt 0 first), got shape "
            f"{tuple(rewards.shape)}"
        )
    return rewards.view(-1, group_size).float()


def grpo_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """GRPO's outcome advantages (Shao et al. 2024, DeepSeekMath section 4.1.2).

    ``A_i = (r_i - mean(group)) / (std(group) + eps)`` with the sample (Bessel) standard
    deviation, as TRL computes it. ``rewards`` is ``[prompts * group_size]``, prompt-major.
    A group whose rewards are all equal gets advantages 0 (it carries no signal).
    """
    if group_size < 2:
        raise ValueError(f"grpo_advantages: group_size must be >= 2, got {group_size}")
    g = _grouped(rewards, group_size, "grpo_advantages")
    mean, std = g.mean(1, keepdim=True), g.std(1, keepdim=True)
    return ((g - mean) / (std + eps)).flatten()


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """REINFORCE leave-one-out (Ahmadian et al. 2024): ``A_i = r_i - mean_{j != i} r_j``."""
    if group_size < 2:
        raise ValueError(f"rloo_advantages: group_size must be >= 2, got {group_size}")
    g = _grouped(rewards, group_size, "rloo_advantages")
    others = (g.sum(1, keepdim=True) - g) / (group_size - 1)
    return (g - others).flatten()


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate ``exp(d) - d - 1`` with ``d = logp_ref - logp``
    (Schulman's k3; unbiased and never negative), the one GRPO uses."""
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1.0


@torch.no_grad()
def ema_update_(
    ema_params: list[torch.Tensor], params: list[torch.Tensor], beta: float = 0.992
) -> None:
    """``theta_ema <- beta theta_ema + (1 - beta) theta`` in place (DeepSpeed-Chat's EMA)."""
    for e, p in zip(ema_params, params, strict=True):
        e.lerp_(p.to(e.dtype), 1.0 - beta)
