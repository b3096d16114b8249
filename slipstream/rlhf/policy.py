"""The policy core every RLHF trainer shares: a causal LM run on a masked batch, the
log-probabilities and entropy of its tokens, the sampling seed of a step, clip statistics.

One causal-LM call (:func:`masked_forward`): ``model(input_ids, attention_mask,
position_ids)`` with the position ids counted from the mask (:func:`position_ids`), so a
left-padded row gets the positions its unpadded tokens would, as in generation (a Hugging
Face model left alone numbers padding too, and a left-padded row's tokens then sit at other
positions than when it was generated). PPO (actor, reference, critic, reward model), GRPO,
DPO, SFT and the reward model's step all score through it.

Log-probabilities (:func:`selective_log_softmax`) and entropy (:func:`entropy_from_logits`)
are computed in fp32 from the logits, the two functions TRL keeps for the same purpose.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.config import ConfigError

__all__ = [
    "answer_logprobs",
    "causal_lm_logits",
    "clip_fraction",
    "entropy_from_logits",
    "masked_forward",
    "masked_mean",
    "micro_batches",
    "output_logits",
    "position_ids",
    "sampling_seed",
    "selective_log_softmax",
]


def position_ids(mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` positions counting each row's real tokens (0 on left padding)."""
    return (mask.cumsum(1) - 1).clamp(min=0)


def masked_forward(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> Any:
    """``model``'s output on ``ids [B, T]`` under ``mask`` with position ids from the mask
    (a causal LM, a :class:`~slipstream.rlhf.sft_reward.RewardModel`, or an engine of one)."""
    return model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask))


def output_logits(out: Any) -> torch.Tensor:
    """The logits of a model's output: a Hugging Face output's ``.logits``, or the tensor the
    reference GPT returns."""
    if isinstance(out, torch.Tensor):
        return out
    logits: torch.Tensor = out.logits if hasattr(out, "logits") else out[0]
    return logits


def causal_lm_logits(
    model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, last: int | None = None
) -> torch.Tensor:
    """Logits predicting tokens ``1 .. T-1`` of ``ids``: ``[B, T - 1, V]``, or those
    predicting the last ``last`` tokens only (``[B, last, V]``)."""
    logits = output_logits(masked_forward(model, ids, mask))[:, :-1]
    return logits if last is None else logits[:, logits.shape[1] - last :]


def selective_log_softmax(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``log p(labels[b, t])`` under ``logits [B, T, V]``: ``[B, T]`` in fp32.

    The caller aligns them (for a causal LM: ``logits[:, :-1]`` with ``ids[:, 1:]``, which
    :func:`causal_lm_logits` already shifted).
    """
    logp = F.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of each position's distribution, ``[B, T]`` in fp32 from ``[B, T, V]``."""
    logp = F.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def answer_logprobs(
    model: nn.Module,
    seqs: torch.Tensor,
    mask: torch.Tensor,
    answer_len: int,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits, log-probabilities)`` of the last ``answer_len`` tokens of ``seqs``, the
    logits divided by ``temperature`` first (the distribution the answers were sampled
    from; see :class:`~slipstream.rlhf.grpo.GRPOConfig`)."""
    logits = causal_lm_logits(model, seqs, mask, last=answer_len)
    if temperature != 1.0:
        logits = logits / temperature
    return logits, selective_log_softmax(logits, seqs[:, -answer_len:])


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over the positions where ``mask`` is 1 (0 when it is all 0)."""
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def clip_fraction(ratio: torch.Tensor, clip: float, mask: torch.Tensor) -> torch.Tensor:
    """Share of the masked tokens whose policy ratio lies outside ``[1 - clip, 1 + clip]``."""
    return masked_mean(((ratio - 1).abs() > clip).to(torch.float32), mask.to(torch.float32))


def sampling_seed(seed: int, step: int, rank: int) -> int:
    """The generation seed of a trainer's ``step`` on ``rank``: every step and every rank
    draws its own answers, and a run is repeatable from ``seed``."""
    return seed + 100_003 * step + 7919 * rank


def micro_batches(
    n: int, gas: int, who: str, what: str = "rows", fix: str = "pass a multiple of it"
) -> tuple[torch.Tensor, ...]:
    """The row indices of each of ``gas`` equal micro-batches of ``n`` rows.

    Raises:
        ConfigError: ``n`` is not a multiple of ``gas`` (``who``, ``what`` and ``fix`` word
            the message).
    """
    if n % gas:
        raise ConfigError(
            f"{who}: {n} {what} do not split into gradient_accumulation_steps={gas} equal "
            f"micro-batches; {fix}"
        )
    return torch.arange(n).chunk(gas)
