"""Choosing the next token: repetition penalty, min-length EOS masking, temperature, top-k,
top-p (nucleus, Holtzman et al. 2020), then argmax or a draw.

Everything is batched over the rows still generating and runs in fp32 whatever the model
dtype, so a bf16 model samples from the same distribution shape as an fp32 one. The order is
Hugging Face's (penalties and masks first, then temperature, top-k, top-p), so settings mean
what they mean there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slipstream.config._errors import ConfigError

__all__ = ["SamplingPolicy", "next_tokens", "sampling_probs"]


@dataclass(frozen=True)
class SamplingPolicy:
    """How the next token is picked. Validated at construction (before any model work)."""

    do_sample: bool = False
    """Draw from the (processed) distribution; False picks the argmax (greedy)."""
    temperature: float = 1.0
    """Logits are divided by it before top-k/top-p (sampling only); must be > 0."""
    top_k: int = 0
    """Keep the k most likely tokens (0: all)."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose probability reaches top_p (1: all)."""
    repetition_penalty: float = 1.0
    """CTRL's penalty (Keskar et al. 2019): logits of tokens already in the sequence are
    divided by it when positive and multiplied when negative (1: off)."""

    def __post_init__(self) -> None:
        checks = [
            (
                "repetition_penalty", self.repetition_penalty, self.repetition_penalty > 0,
                "a number > 0 (1.0 is off, 1.1-1.3 is typical)",
            ),
        ]  # fmt: skip
        if self.do_sample:  # greedy ignores the warping knobs (HF only warns there)
            checks += [
            ("temperature", self.temperature, self.temperature > 0, "a number > 0, e.g. 0.7"),
            ("top_k", self.top_k, self.top_k >= 0, "an int >= 0 (0 keeps every token)"),
            ("top_p", self.top_p, 0 < self.top_p <= 1, "a number in (0, 1], e.g. 0.9"),
        ]  # fmt: skip
        for name, value, ok, want in checks:
            if isinstance(value, bool) or not ok:
                raise ConfigError(f"generate: {name}={value!r} is invalid; use {want}")

    @property
    def warps(self) -> bool:
        """Whether sampling reshapes the distribution at all."""
        return self.temperature != 1.0 or self.top_k > 0 or self.top_p < 1.0


def _penalize_repeats(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL repetition penalty on the tokens of ``seen [b, t]`` (padding may repeat: harmless,
    a token id is penalized once however often it occurs)."""
    picked = logits.gather(1, seen)
    picked = torch.where(picked < 0, picked * penalty, picked / penalty)
    return logits.scatter(1, seen, picked)


def _top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[:, -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def _top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Drop the least likely tokens whose total probability is at most ``1 - p``; the most
    likely token always stays."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=False, dim=-1)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop_sorted = cumulative <= (1 - p)
    drop_sorted[:, -1] = False
    drop = drop_sorted.scatter(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def next_tokens(
    logits: torch.Tensor,
    policy: SamplingPolicy,
    *,
    seen: torch.Tensor | None = None,
    banned: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The next token ``[b]`` for each row of ``logits [b, vocab]``.

    Args:
        seen: ``[b, t]`` token ids already in each sequence, for the repetition penalty.
        banned: token ids whose logits are set to -inf (EOS before ``min_new_tokens``).
        generator: RNG for the draw; the same generator state gives the same tokens.
    """
    logits = logits.float()
    if policy.repetition_penalty != 1.0 and seen is not None:
        logits = _penalize_repeats(logits, seen, policy.repetition_penalty)
    if banned is not None and banned.numel():
        logits = logits.index_fill(1, banned, float("-inf"))
    if not policy.do_sample:
        return logits.argmax(dim=-1)
    probs = sampling_probs(logits, policy)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def sampling_probs(logits: torch.Tensor, policy: SamplingPolicy) -> torch.Tensor:
    """The distribution :func:`next_tokens` draws from when sampling, after any penalty and
    bans: temperature, top-k, top-p, softmax, row by row (fp32), ``[b, vocab]``."""
    logits = logits.float()
    if policy.temperature != 1.0:
        logits = logits / policy.temperature
    logits = _top_p(_top_k(logits, policy.top_k), policy.top_p)
    return logits.softmax(dim=-1)
