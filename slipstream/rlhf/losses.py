"""RLHF losses as pure functions on tensors: reward model, PPO actor and critic, GRPO, DPO.

Formulas follow DeepSpeed-Chat (Yao et al. 2023, arXiv 2308.01320, step 2 and step 3) as the
project spec (``specs/quantization-rlhf-multimodal.md`` section 3.2) writes them down, GRPO
(Shao et al. 2024, DeepSeekMath eq. 3) and DPO (Rafailov et al. 2023, eq. 7). Nothing here touches a model: callers pass log-probabilities,
values and rewards, so every formula is testable on made-up tensors.

Shapes: ``B`` sequences, ``T`` positions. Masks are 1 for positions that count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from slipstream.rlhf.advantages import k3_kl
from slipstream.rlhf.policy import masked_mean
from slipstream.rlhf.policy import selective_log_softmax as token_logprobs

__all__ = [
    "DPOOutput",
    "GRPOLossOutput",
    "RewardModelOutput",
    "causal_lm_loss",
    "dpo_loss",
    "first_pad_index",
    "grpo_loss",
    "ppo_actor_loss",
    "ppo_critic_loss",
    "reward_model_loss",
    "token_logprobs",
]


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (fp32) of ``logits [B, T, V]`` against ``labels [B, T]``
    aligned with the inputs (position ``t`` predicts ``labels[:, t + 1]``, as Hugging Face
    shifts them); -100 is ignored. Step 1's loss and PPO's PTX term, for any causal LM."""
    return F.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.shape[-1]),
        labels[:, 1:].reshape(-1),
        ignore_index=-100,
    )


@dataclass(frozen=True)
class RewardModelOutput:
    """Step-2 results for a batch of pairs.

    Attributes:
        loss: mean over pairs of the divergent-suffix pairwise loss (scalar, differentiable).
        chosen_scores: ``[B]`` reward at the last non-pad token of each chosen sequence.
        rejected_scores: ``[B]`` the same for the rejected sequences.
        accuracy: share of pairs with ``chosen_score > rejected_score`` (a float tensor).
    """

    loss: torch.Tensor
    chosen_scores: torch.Tensor
    rejected_scores: torch.Tensor
    accuracy: torch.Tensor


def first_pad_index(ids: torch.Tensor, pad_token_id: int, skip: int = 0) -> int:
    """Index of the first padding token of a 1-D ``ids`` after skipping ``skip`` occurrences
    (OPT starts every sequence with a token equal to its pad id); ``len(ids)`` if none."""
    where = (ids == pad_token_id).nonzero().flatten()
    return int(where[skip]) if where.numel() > skip else ids.numel()


def reward_model_loss(
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    chosen_ids: torch.Tensor,
    rejected_ids: torch.Tensor,
    pad_token_id: int,
    num_padding_at_beginning: int = 0,
) -> RewardModelOutput:
    """DeepSpeed-Chat's pairwise reward-model loss over the divergent suffix.

    For each pair, ``d`` is the first index where the chosen and rejected ids differ and
    ``e = max(end_c, end_r)`` the later of their first padding indices; the loss is
    ``-mean_{t in [d, e)} log sigmoid(r_c[t] - r_r[t])``, averaged over pairs. It is a
    per-token loss over the whole suffix, not a last-token loss. A pair whose two sequences
    are identical uses the last position only (its loss is then ``log 2``).

    Args:
        chosen_rewards, rejected_rewards: ``[B, T]`` the value head's output per token.
        chosen_ids, rejected_ids: ``[B, T]`` right-padded token ids.
        pad_token_id: the padding id.
        num_padding_at_beginning: leading pad-id tokens that are not padding (1 for OPT).
    """
    if chosen_rewards.shape != rejected_rewards.shape or chosen_ids.shape != rejected_ids.shape:
        raise ValueError(
            "reward_model_loss: chosen and rejected tensors must have the same shape, got "
            f"rewards {tuple(chosen_rewards.shape)} / {tuple(rejected_rewards.shape)} and ids "
            f"{tuple(chosen_ids.shape)} / {tuple(rejected_ids.shape)}; pad both to one length"
        )
    losses, c_scores, r_scores = [], [], []
    for rc, rr, ic, ir in zip(chosen_rewards, rejected_rewards, chosen_ids, rejected_ids):
        end_c = first_pad_index(ic, pad_token_id, num_padding_at_beginning)
        differ = (ic != ir).nonzero().flatten()
        if differ.numel() == 0:
            end_r, start, stop = end_c, ic.numel() - 1, ic.numel()
        else:
            end_r = first_pad_index(ir, pad_token_id, num_padding_at_beginning)
            start, stop = int(differ[0]), max(end_c, end_r)
        losses.append(-F.logsigmoid(rc[start:stop] - rr[start:stop]).mean())
        c_scores.append(rc[end_c - 1])
        r_scores.append(rr[end_r - 1])
    chosen, rejected = torch.stack(c_scores), torch.stack(r_scores)
    return RewardModelOutput(
        loss=torch.stack(losses).mean(),
        chosen_scores=chosen,
        rejected_scores=rejected,
        accuracy=(chosen > rejected).float().mean(),
    )


def ppo_actor_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip: float = 0.2,
) -> torch.Tensor:
    """Clipped PPO surrogate (Schulman et al. 2017, eq. 7), DeepSpeed-Chat's token average.

    ``rho = exp(m (logp - logp_old))``; the loss is
    ``sum m * max(-A rho, -A clip(rho, 1 - clip, 1 + clip)) / sum m``. All ``[B, T]``.
    """
    ratio = torch.exp((logprobs - old_logprobs) * mask)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip, 1.0 + clip)
    return masked_mean(torch.maximum(unclipped, clipped), mask)


def ppo_critic_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float = 0.2,
) -> torch.Tensor:
    """Clipped value loss: ``0.5 sum m max((V-G)^2, (clip(V, V_old +- clip) - G)^2) / sum m``."""
    clipped = torch.maximum(torch.minimum(values, old_values + clip), old_values - clip)
    worst = torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
    return 0.5 * masked_mean(worst, mask)


@dataclass(frozen=True)
class GRPOLossOutput:
    """GRPO's loss on a batch of answers and the per-token terms it was made of.

    Attributes:
        loss: mean over answers of each answer's token mean (scalar, differentiable).
        ratio: ``[B, T]`` policy ratio ``exp(logp - logp_old)``.
        kl: ``[B, T]`` k3 KL estimate to the reference (0 without one), detached.
    """

    loss: torch.Tensor
    ratio: torch.Tensor
    kl: torch.Tensor


def grpo_loss(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    clip: float = 0.2,
    kl_coef: float = 0.0,
) -> GRPOLossOutput:
    """GRPO's objective (Shao et al. 2024, DeepSeekMath eq. 3), negated.

    Per token ``-min(rho A, clip(rho, 1 - clip, 1 + clip) A) + kl_coef k3``; each answer's
    loss is the mean over its tokens (``mask``), the batch loss the mean over answers.

    Args:
        logprobs: ``[B, T]`` the answers' log-probabilities under the policy (with grad).
        advantages: ``[B]`` one advantage per answer (every token gets it).
        mask: ``[B, T]`` 1 on answer tokens.
        old_logprobs: the same before this batch's first update; None takes the detached
            ``logprobs`` (one update per batch: the ratio is 1, its gradient the policy's).
        ref_logprobs: the reference model's, for the KL term (None: no KL).
    """
    old = logprobs.detach() if old_logprobs is None else old_logprobs
    ratio = torch.exp(logprobs - old)
    a = advantages.unsqueeze(1)
    per_token = -torch.minimum(ratio * a, ratio.clamp(1 - clip, 1 + clip) * a)
    kl = k3_kl(logprobs, ref_logprobs) if ref_logprobs is not None else torch.zeros_like(logprobs)
    per_token = per_token + kl_coef * kl
    m = mask.to(per_token.dtype)
    loss = ((per_token * m).sum(1) / m.sum(1).clamp(min=1.0)).mean()
    return GRPOLossOutput(loss=loss, ratio=ratio.detach(), kl=kl.detach())


@dataclass(frozen=True)
class DPOOutput:
    """DPO results for a batch of pairs.

    Attributes:
        loss: mean of ``-log sigmoid(beta (chosen_margin - rejected_margin))`` (scalar).
        chosen_rewards: ``[B]`` implicit rewards ``beta (log pi - log pi_ref)`` of chosen.
        rejected_rewards: ``[B]`` the same for rejected.
        accuracy: share of pairs whose chosen implicit reward is the larger.
    """

    loss: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    accuracy: torch.Tensor


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float = 0.1,
) -> DPOOutput:
    """Direct Preference Optimization (Rafailov et al. 2023, eq. 7) on summed response
    log-probabilities ``[B]`` of the policy and the frozen reference."""
    chosen = beta * (policy_chosen - ref_chosen)
    rejected = beta * (policy_rejected - ref_rejected)
    return DPOOutput(
        loss=-F.logsigmoid(chosen - rejected).mean(),
        chosen_rewards=chosen.detach(),
        rejected_rewards=rejected.detach(),
        accuracy=(chosen > rejected).float().mean(),
    )
