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

import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.config import ConfigError

__all__ = [
    "RaggedChunk",
    "answer_logprobs",
    "causal_lm_logits",
    "clip_fraction",
    "entropy_from_logits",
    "masked_forward",
    "masked_mean",
    "micro_batches",
    "output_logits",
    "position_ids",
    "ragged_answer_logprobs",
    "ragged_chunks",
    "sampling_seed",
    "selective_log_softmax",
]


def position_ids(mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` positions counting each row's real tokens (0 on left padding)."""
    return (mask.cumsum(1) - 1).clamp(min=0)


def masked_forward(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, **kwargs: Any) -> Any:
    """``model``'s output on ``ids [B, T]`` under ``mask`` with position ids from the mask
    (a causal LM, a :class:`~slipstream.rlhf.sft_reward.RewardModel`, or an engine of one);
    ``kwargs`` go to the model too."""
    return model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask), **kwargs)


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
    logits = logits.float()
    picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)  # no [B, T, V] log-probabilities kept


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


@dataclass(frozen=True)
class RaggedChunk:
    """Rows of a ``[N, P + A]`` batch (left-padded prompts, right-padded answers) scored
    together in the narrowest window holding them all (:func:`ragged_chunks`)."""

    rows: torch.Tensor
    """Row indices into the batch."""
    start: int
    """First column kept: the earliest real prompt token of these rows."""
    answer_len: int
    """Answer columns kept: the longest of these rows' answers."""


def ragged_chunks(
    mask: torch.Tensor, answer: torch.Tensor, per_chunk_tokens: int = 32
) -> list[RaggedChunk]:
    """Split a batch of ragged answers into groups of rows of similar length, so that the
    positions a forward computes are mostly real tokens, not padding.

    Rows are sorted by answer length and cut into consecutive groups minimizing
    ``sum(rows x window width) + per_chunk_tokens x groups``: the window of a group runs
    from its earliest real prompt token to its longest answer's end, and
    ``per_chunk_tokens`` prices one more forward (and backward) in positions. One group,
    the whole batch trimmed, when that is cheapest (equal lengths).

    Args:
        mask: ``[N, P + A]`` attention mask (left-padded prompt, then the answer mask).
        answer: ``[N, A]`` answer mask, 1 on each answer's tokens (a prefix of the row).
    """
    n, width = mask.shape
    prompt_len = width - answer.shape[1]
    columns = torch.arange(1, answer.shape[1] + 1)
    lengths = (answer.bool() * columns).amax(1).tolist()  # through each row's last answer token
    firsts = mask[:, :prompt_len].long().argmax(1)  # first real prompt token of each row
    firsts = torch.where(mask[:, :prompt_len].any(1), firsts, prompt_len).tolist()
    order = sorted(range(n), key=lambda r: (lengths[r], firsts[r]))
    # Rows of equal answer length always share a group: dynamic programming over the
    # distinct lengths (at most A of them), not over rows.
    groups: list[list[int]] = []
    for r in order:
        if groups and lengths[groups[-1][0]] == lengths[r]:
            groups[-1].append(r)
        else:
            groups.append([r])
    best = [0.0] + [float("inf")] * len(groups)  # best[j]: cost of the first j groups
    cut = [0] * (len(groups) + 1)
    for j in range(1, len(groups) + 1):
        rows, start = 0, prompt_len
        for i in range(j, 0, -1):  # groups i-1 .. j-1 in one chunk
            rows += len(groups[i - 1])
            start = min(start, min(firsts[r] for r in groups[i - 1]))
            cost = best[i - 1] + rows * (prompt_len - start + lengths[groups[j - 1][0]])
            cost += per_chunk_tokens
            if cost < best[j]:
                best[j], cut[j] = cost, i - 1
    chunks: list[RaggedChunk] = []
    j = len(groups)
    while j > 0:
        i = cut[j]
        rows_list = [r for g in groups[i:j] for r in g]
        start = min(firsts[r] for r in rows_list)
        length = max(1, lengths[groups[j - 1][0]])
        chunks.append(RaggedChunk(torch.tensor(rows_list), min(start, prompt_len - 1), length))
        j = i
    return chunks[::-1]


def _keeps_logits(model: nn.Module) -> bool:
    """Whether ``model`` (or the module an engine wraps) takes Hugging Face's
    ``logits_to_keep`` (the LM head then runs on the last positions only)."""
    inner = getattr(model, "module", model)
    try:
        params = inspect.signature(type(inner).forward).parameters
    except (TypeError, ValueError):
        return False
    return "logits_to_keep" in params


def ragged_answer_logprobs(
    model: nn.Module,
    seqs: torch.Tensor,
    mask: torch.Tensor,
    answer: torch.Tensor,
    temperature: float = 1.0,
    chunks: list[RaggedChunk] | None = None,
    entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`answer_logprobs` of a batch of ragged answers, padding left out.

    Each chunk (default: :func:`ragged_chunks`) runs one forward on its rows' window: the
    columns before its earliest prompt token and after its longest answer are dropped (no
    real token attends to them, so the answers' log-probabilities are the same), and the LM
    head runs on the answer positions only when the model takes ``logits_to_keep``. The
    pieces are put back in the batch's order and padded with 0 to ``[N, A]``; gradients
    flow through them as through one forward.

    Returns:
        ``(log-probabilities [N, A], entropy [N, A] or None)``: the entropy (detached) of the
        tempered distributions when ``entropy``. Positions past a row's answer hold 0.
    """
    n, width = answer.shape
    chunks = ragged_chunks(mask, answer) if chunks is None else chunks
    keep = _keeps_logits(model)
    pieces, entropies, rows = [], [], []
    for c in chunks:
        stop = seqs.shape[1] - width + c.answer_len
        ids, m = seqs[c.rows, c.start : stop], mask[c.rows, c.start : stop]
        if keep:
            out = masked_forward(model, ids, m, logits_to_keep=c.answer_len + 1)
            logits = output_logits(out)[:, :-1]
        else:
            logits = causal_lm_logits(model, ids, m, last=c.answer_len)
        if temperature != 1.0:
            logits = logits / temperature
        pad = (0, width - c.answer_len)
        pieces.append(F.pad(selective_log_softmax(logits, ids[:, -c.answer_len :]), pad))
        if entropy:
            with torch.no_grad():
                entropies.append(F.pad(entropy_from_logits(logits), pad))
        rows.append(c.rows)
    inverse = torch.empty(n, dtype=torch.long)
    inverse[torch.cat(rows)] = torch.arange(n)
    logp = torch.cat(pieces)[inverse]
    return logp, (torch.cat(entropies)[inverse] if entropy else None)


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
