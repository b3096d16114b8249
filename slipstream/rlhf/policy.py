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
from collections.abc import Callable
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
    mask: torch.Tensor,
    answer: torch.Tensor,
    per_chunk_tokens: int = 32,
    with_prompt: bool = True,
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
        with_prompt: the window counts the prompt's columns (False: each prompt runs once
            on its own, the chunks' forwards hold the answers only).
    """
    n, width = mask.shape
    prompt_len = width - answer.shape[1]
    columns = torch.arange(1, answer.shape[1] + 1)
    # Through each row's last answer token; each row's first real prompt token.
    lengths: list[int] = (answer.bool() * columns).amax(1).tolist()
    real = mask[:, :prompt_len].bool()
    firsts: list[int] = torch.where(real.any(1), real.long().argmax(1), prompt_len).tolist()
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
        n_rows, first = 0, prompt_len
        for i in range(j, 0, -1):  # groups i-1 .. j-1 in one chunk
            n_rows += len(groups[i - 1])
            first = min(first, *(firsts[r] for r in groups[i - 1]))
            prompt = prompt_len - first if with_prompt else 0
            cost = best[i - 1] + n_rows * (prompt + lengths[groups[j - 1][0]])
            cost += per_chunk_tokens
            if cost < best[j]:
                best[j], cut[j] = cost, i - 1
    chunks: list[RaggedChunk] = []
    j = len(groups)
    while j > 0:
        i = cut[j]
        rows = [r for g in groups[i:j] for r in g]
        start = min(prompt_len - 1, *(firsts[r] for r in rows))
        length = max(1, lengths[groups[j - 1][0]])
        chunks.append(RaggedChunk(torch.tensor(rows), start, length))
        j = i
    return chunks[::-1]


def _forward_params(model: nn.Module) -> set[str]:
    """The keyword names ``model``'s forward (or that of the module an engine wraps) takes."""
    inner = getattr(model, "module", model)
    try:
        return set(inspect.signature(type(inner).forward).parameters)
    except (TypeError, ValueError):
        return set()


def _keeps_logits(model: nn.Module) -> bool:
    """Whether ``model`` takes Hugging Face's ``logits_to_keep`` (the LM head then runs on
    the last positions only)."""
    return "logits_to_keep" in _forward_params(model)


def _cache_keyword(model: nn.Module) -> str | None:
    """The keyword a Hugging Face causal LM takes its KV cache by (``cache`` from
    transformers 5.24, ``past_key_values`` before), None if it takes none."""
    params = _forward_params(model)
    if "use_cache" not in params or "logits_to_keep" not in params:
        return None
    return next((k for k in ("cache", "past_key_values") if k in params), None)


def ragged_answer_logprobs(
    model: nn.Module,
    seqs: torch.Tensor,
    mask: torch.Tensor,
    answer: torch.Tensor,
    temperature: float = 1.0,
    chunks: list[RaggedChunk] | None = None,
    entropy: bool = False,
    share_prompts: bool = True,
    agree: Callable[[int], int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`answer_logprobs` of a batch of ragged answers, padding and repeated prompts
    left out.

    Each chunk (default: :func:`ragged_chunks`) runs one forward on its rows' window: the
    columns before its earliest prompt token and from its longest answer's last token on
    are dropped (no scored token attends to them, and the last token predicts nothing
    scored), and the LM head runs on the answer positions only when the model takes
    ``logits_to_keep``. With ``share_prompts``, a Hugging Face causal LM with a
    :class:`transformers.DynamicCache`, and rows that repeat a prompt (GRPO's group), each
    distinct prompt runs once and its keys and values serve every answer to it (the
    answers' forwards continue from the prompt's cache, gradients flowing back into it).
    The pieces are put back in the batch's order and padded with 0 to ``[N, A]``;
    gradients flow through them as through one forward.

    How many forwards that takes depends on the batch. Where ranks must run every forward
    (and its backward) together, because a forward holds collectives (ZeRO-3 gathers each
    unit's parameters in the forward and again in the backward), ``agree`` maps this
    rank's count to the count every rank runs (e.g. the largest,
    :func:`slipstream.distributed.comm.max_int`); a rank with fewer then runs the rest as
    one-token forwards whose logits enter the result times 0, so their backward passes
    run too. Every forward goes through the same modules in the same order, so the
    ranks' collectives pair up whatever each forward holds.

    Returns:
        ``(log-probabilities [N, A], entropy [N, A] or None)``: the entropy (detached) of the
        tempered distributions when ``entropy``. Positions past a row's answer hold 0.
    """
    n, width = answer.shape
    keep = _keeps_logits(model)
    prompts: _SharedPrompts | None = None
    spare: list[torch.Tensor] = []
    if share_prompts and keep:
        prompts, spare = _shared_prompts(model, seqs, mask, width)
    if chunks is None:
        chunks = ragged_chunks(mask, answer, with_prompt=prompts is None)
    if agree is None:
        spare = []  # a forward no other rank needs to match: its output is dropped
    else:
        ran = int(prompts is not None) + len(spare)
        ran += sum(1 for c in chunks if prompts is None or c.answer_len > 1)
        for _ in range(agree(ran) - ran):
            kwargs = {"logits_to_keep": 1} if keep else {}
            one = torch.ones(1, 1, dtype=mask.dtype, device=mask.device)
            spare.append(output_logits(masked_forward(model, seqs[:1, -1:], one, **kwargs)))
    pieces, entropies, rows = [], [], []
    for c in chunks:
        a, stop = c.answer_len, seqs.shape[1] - width + c.answer_len
        labels = seqs[c.rows, stop - a : stop]
        if prompts is not None:
            logits = prompts.answer_logits(model, seqs, mask, c.rows, a)
        else:
            ids, m = seqs[c.rows, c.start : stop - 1], mask[c.rows, c.start : stop - 1]
            kwargs = {"logits_to_keep": a} if keep else {}
            logits = output_logits(masked_forward(model, ids, m, **kwargs))[:, -a:]
        if temperature != 1.0:
            logits = logits / temperature
        pad = (0, width - a)
        pieces.append(F.pad(selective_log_softmax(logits, labels), pad))
        if entropy:
            with torch.no_grad():
                entropies.append(F.pad(entropy_from_logits(logits), pad))
        rows.append(c.rows)
    inverse = torch.empty(n, dtype=torch.long)
    inverse[torch.cat(rows)] = torch.arange(n)
    logp = torch.cat(pieces)[inverse]
    if spare and torch.is_grad_enabled():  # their backward runs too (zero gradients)
        logp = logp + torch.stack([x.float().sum() for x in spare]).sum() * 0.0
    return logp, (torch.cat(entropies)[inverse] if entropy else None)


@dataclass
class _SharedPrompts:
    """The distinct prompts of a batch run once: their per-layer keys and values and the
    logits of their last position (the prediction of every answer's first token)."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]
    last_logits: torch.Tensor
    """``[U, V]``"""
    index: torch.Tensor
    """``[N]``: each row's prompt."""
    start: int
    """First prompt column the cache holds."""
    prompt_len: int
    """Prompt columns of the batch (answers start there)."""
    keyword: str
    """The keyword the model takes its cache by."""

    def answer_logits(
        self,
        model: nn.Module,
        seqs: torch.Tensor,
        mask: torch.Tensor,
        rows: torch.Tensor,
        answer_len: int,
    ) -> torch.Tensor:
        """Logits ``[r, answer_len, V]`` predicting the first ``answer_len`` answer tokens of
        ``rows``: the prompt's last position, then a forward of the answer tokens (all but
        the last) on a cache holding the rows' prompts."""
        from transformers import DynamicCache

        which = self.index[rows]
        first = self.last_logits[which].unsqueeze(1)
        if answer_len == 1:
            return first
        prompt_len = self.prompt_len
        stop = prompt_len + answer_len - 1
        window = mask[rows, self.start : stop]
        cache = DynamicCache(ddp_cache_data=[(k[which], v[which]) for k, v in self.kv])
        out = model(
            input_ids=seqs[rows, prompt_len:stop],
            attention_mask=window,
            position_ids=position_ids(window)[:, prompt_len - self.start :],
            use_cache=True,
            **{self.keyword: cache},
        )
        return torch.cat([first, output_logits(out)], dim=1)


def _shared_prompts(
    model: nn.Module, seqs: torch.Tensor, mask: torch.Tensor, answer_width: int
) -> tuple[_SharedPrompts | None, list[torch.Tensor]]:
    """Run each distinct prompt of the batch once (see :func:`ragged_answer_logprobs`);
    None when no prompt repeats or the model does not keep a plain
    :class:`transformers.DynamicCache` (other cache classes, sliding windows, activation
    checkpointing, transformers without ``DynamicLayer``). The list holds the logits of a
    forward that ran but whose cache cannot serve (the caller counts it, and keeps it in
    the graph so its backward runs as on other ranks)."""
    keyword = _cache_keyword(model)
    try:
        from transformers.cache_utils import DynamicCache, DynamicLayer
    except ImportError:
        return None, []
    inner = getattr(model, "module", model)
    flag = "is_activation_checkpointing"  # transformers 5 (before: is_gradient_checkpointing)
    flag = flag if hasattr(type(inner), flag) else "is_gradient_checkpointing"
    if keyword is None or getattr(inner, flag, False):
        return None, []  # Hugging Face turns the cache off under checkpointing in training
    n, prompt_len = seqs.shape[0], seqs.shape[1] - answer_width
    pm = mask[:, :prompt_len]
    key = torch.cat([seqs[:, :prompt_len] * pm, pm], dim=1)
    unique, index = torch.unique(key, dim=0, return_inverse=True)
    if unique.shape[0] == n:
        return None, []
    first = torch.full((unique.shape[0],), n, dtype=torch.long)
    first.scatter_reduce_(0, index, torch.arange(n), reduce="amin")
    real = pm[first].bool()
    start = int(real.long().argmax(1).min()) if bool(real.any()) else prompt_len - 1
    start = min(start, prompt_len - 1)
    ids, m = seqs[first, start:prompt_len], mask[first, start:prompt_len]
    out = masked_forward(model, ids, m, use_cache=True, logits_to_keep=1)
    cache = out.get(keyword) if hasattr(out, "get") else None
    layers = getattr(cache, "layers", None)
    if (
        type(cache) is not DynamicCache
        or not layers
        or any(type(layer) is not DynamicLayer for layer in layers)
    ):
        return None, [output_logits(out)]
    kv = [(layer.keys, layer.values) for layer in layers]
    shared = _SharedPrompts(kv, output_logits(out)[:, -1], index, start, prompt_len, keyword)
    return shared, []


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
