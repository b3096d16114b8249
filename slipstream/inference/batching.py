"""Continuous batching with chunked prefill on the paged KV cache.

Every :meth:`ContinuousBatchingEngine.step` is one scheduler iteration and one model forward
over a flat batch of tokens (DeepSpeed-FastGen's Dynamic SplitFuse, Holmes et al. 2024):

1. each running sequence gets its next tokens, oldest first: one token when it is decoding,
   the next chunk of its prompt when it is still prefilling;
2. waiting requests are admitted, oldest first, while ``max_num_seqs`` and the step's token
   budget (``max_tokens_per_step``) allow; a long prompt takes what is left of the budget
   and continues in the next steps, sharing each forward with the running decodes;
3. when the KV pool has no free block for a running sequence, the youngest running sequence
   is preempted: its blocks are freed and it waits again, to be recomputed (prompt and tokens
   so far, as a prefill) when blocks free up. A request that could never fit (its prompt plus
   ``max_new_tokens`` longer than ``max_model_len`` or than the whole pool) is refused by
   :meth:`add_request`, so preemption always ends and nothing runs out of memory.

Requests with the same prompt added while the first of them has not finished its prefill
(the ``n`` samples of a GRPO group, best-of-n) share its prompt blocks: the first computes
the prompt, the others fork its block table and draw their first token from the same logits,
each with its own generator.

Sampling: each request has its own ``torch.Generator`` (seeded from ``seed``; without a seed
the global RNG), and its token is drawn from its own row of logits, so a request's tokens do
not depend on which others share its batches: they are those of
``slipstream.inference.generate(model, input_ids=prompt[None], seed=seed, ...)`` (the static
engine) for the same prompt. Greedy and sampled tokens are equal; the logits agree to fp32
rounding (batch shapes change reduction order), measured below 1e-4 on the test models.
"""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from slipstream.inference.paged import NoFreeBlocks, PagedKVCache
from slipstream.inference.paged_models import Runner, runner_for

# The request types are the serving interface's, which this engine implements.
from slipstream.inference.serving.protocol import RequestOutput, SamplingParams
from slipstream.models.sampling import SamplingPolicy, next_tokens, sampling_probs

__all__ = ["ContinuousBatchingEngine", "RequestOutput", "SamplingParams"]


@dataclass(eq=False)
class _Seq:
    rid: str
    tokens: list[int]
    prompt_len: int
    max_new: int
    policy: SamplingPolicy
    generator: torch.Generator | None
    stops: frozenset[int]
    min_new: int = 0
    arrival: int = 0
    table: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    """Pool slots of positions ``0..computed-1`` (kept in step with ``table``)."""
    computed: int = 0
    """Positions whose keys and values are in the cache."""
    followers: list[_Seq] = field(default_factory=list)
    """Requests with the same prompt that will fork this one's prompt blocks."""

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len


class ContinuousBatchingEngine:
    """Continuous batching on a paged KV cache for one model (not thread-safe).

    Args:
        model: slipstream's GPT or a Hugging Face LLaMA-family, GPT-2 or OPT causal LM, in
            eval mode, on the device it should run on.
        block_size: positions per KV block.
        num_blocks: blocks in the pool (None: room for ``max_num_seqs`` sequences of
            ``min(max_model_len, 512)`` tokens, and at least one of ``max_model_len``).
        max_num_seqs: most sequences in one step.
        max_tokens_per_step: token budget of one forward (decodes plus prefill chunks).
        max_model_len: longest prompt plus answer (None: the model's context).
        dtype: dtype of the cached keys and values (None: the model's).
        runner: ``model``'s paged forward (``paged_models.runner_for(model)``) to reuse,
            with its packed weights; None prepares one.
        agree: called with each step's chosen tokens (a 1-d tensor, in the step's order)
            and returns the tokens to use: tensor-parallel ranks running the same schedule
            take TP rank 0's (``TPRankSync.tokens``), so their batches never diverge.

    Raises:
        ConfigError: a model the paged forward does not drive, or a bad setting.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        block_size: int = 16,
        num_blocks: int | None = None,
        max_num_seqs: int = 64,
        max_tokens_per_step: int = 512,
        max_model_len: int | None = None,
        dtype: torch.dtype | None = None,
        runner: Runner | None = None,
        agree: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        from slipstream.config._errors import ConfigError

        if runner is not None and runner.model is not model:
            raise ConfigError("ContinuousBatchingEngine: runner= was prepared for another model")
        self.runner = runner = runner if runner is not None else runner_for(model)
        context = runner.context
        if max_model_len is None:
            if context is None:
                raise ConfigError(
                    "ContinuousBatchingEngine: the model does not say its context length; "
                    "pass max_model_len="
                )
            max_model_len = context
        for name, value in (("block_size", block_size), ("max_num_seqs", max_num_seqs),
                            ("max_tokens_per_step", max_tokens_per_step),
                            ("max_model_len", max_model_len)):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"ContinuousBatchingEngine: {name}={value!r} must be an int >= 1")
        if context is not None and max_model_len > context:
            raise ConfigError(
                f"ContinuousBatchingEngine: max_model_len={max_model_len} exceeds the model's "
                f"context of {context} positions; use max_model_len <= {context}"
            )
        self.max_model_len: int = max_model_len
        per_seq = -(-max_model_len // block_size)
        if num_blocks is None:
            num_blocks = max(per_seq, max_num_seqs * -(-min(max_model_len, 512) // block_size))
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ConfigError(f"ContinuousBatchingEngine: num_blocks={num_blocks!r} must be >= 1")
        self.cache = PagedKVCache(
            runner.num_layers, num_blocks, block_size, runner.kv_heads, runner.head_dim,
            dtype or runner.dtype, runner.device,
        )  # fmt: skip
        self.max_num_seqs = max_num_seqs
        self.max_tokens_per_step = max_tokens_per_step
        self.eos_token_ids: tuple[int, ...] = _eos_ids(model)
        self.num_preemptions = 0
        self.num_forwards = 0
        """Model forwards so far (a :meth:`step` with nothing scheduled makes none)."""
        self._agree = agree
        self._seqs: dict[str, _Seq] = {}
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []
        self._leaders: dict[tuple[int, ...], _Seq] = {}
        self._pending: list[RequestOutput] = []
        self._arrivals = 0

    # ---- the contract -------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """Queue a request; it joins the batch at the next :meth:`step`.

        Raises:
            ValueError: a duplicate ``request_id``, an empty prompt, a token outside the
                vocabulary, ``max_new_tokens`` < 1, bad sampling settings, or a prompt plus
                ``max_new_tokens`` longer than ``max_model_len`` or the whole KV pool.
        """
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops |= set(self.eos_token_ids)
        policy = SamplingPolicy(
            do_sample=bool(params.do_sample), temperature=float(params.temperature),
            top_k=params.top_k or 0, top_p=1.0 if params.top_p is None else float(params.top_p),
        )  # fmt: skip
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.runner.device)
            generator.manual_seed(int(params.seed))
        self._add(request_id, list(prompt_ids), params.max_new_tokens, policy, generator, stops)

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its blocks; the next :meth:`step` reports it finished
        with ``finish_reason="abort"``. An unknown or finished id is ignored."""
        seq = self._seqs.get(request_id)
        if seq is not None:
            self._drop(seq)
            self._pending.append(RequestOutput(request_id, [], True, "abort"))

    def step(self) -> list[RequestOutput]:
        """One scheduler iteration and (when anything is scheduled) one forward.

        Returns the outputs of the requests that produced tokens or finished. If the forward
        raises, the requests of that batch are aborted (blocks freed, reported with
        ``finish_reason="abort"`` by the next step) and the error propagates.
        """
        outputs, self._pending = self._pending, []
        decodes, chunks = self._schedule()
        if not decodes and not chunks:
            return outputs
        try:
            with self.runner.step_scope():
                produced = self._forward(decodes, chunks)
            self.num_forwards += 1
            if self._agree is not None and produced:
                chosen = torch.tensor([token for _, token in produced], dtype=torch.long)
                agreed = self._agree(chosen.to(self.runner.device)).tolist()
                produced = [(seq, agreed[j]) for j, (seq, _) in enumerate(produced)]
        except BaseException:
            for seq in [*decodes, *(s for s, _ in chunks)]:
                for member in [seq, *seq.followers]:
                    if member.rid in self._seqs:
                        self.abort(member.rid)
            raise
        for seq, token in produced:
            outputs.append(self._emit(seq, token))
        return outputs

    def has_unfinished(self) -> bool:
        return bool(self._seqs or self._pending)

    def free_blocks(self) -> int:
        return self.cache.allocator.num_free()

    def total_blocks(self) -> int:
        return self.cache.allocator.num_blocks

    # ---- requests -----------------------------------------------------------------------

    def _add(
        self,
        rid: str,
        prompt: list[int],
        max_new: int,
        policy: SamplingPolicy,
        generator: torch.Generator | None,
        stops: set[int],
        min_new: int = 0,
    ) -> None:
        if rid in self._seqs:
            raise ValueError(f"add_request: request_id {rid!r} is already running")
        if not prompt:
            raise ValueError(f"add_request {rid!r}: the prompt has no tokens")
        vocab = self.runner.vocab_size
        bad = [t for t in prompt if not _is_token(t, vocab)]
        if bad:
            raise ValueError(
                f"add_request {rid!r}: token {bad[0]!r} is not a token id of this model "
                f"(vocabulary of {vocab})"
            )
        if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1:
            raise ValueError(f"add_request {rid!r}: max_new_tokens={max_new!r} must be >= 1")
        total = len(prompt) + max_new
        if total > self.max_model_len:
            raise ValueError(
                f"add_request {rid!r}: prompt ({len(prompt)} tokens) plus max_new_tokens "
                f"({max_new}) is {total} tokens, more than max_model_len={self.max_model_len}; "
                "shorten the prompt or lower max_new_tokens"
            )
        if self.cache.blocks_for(total) > self.total_blocks():
            raise ValueError(
                f"add_request {rid!r}: {total} tokens need {self.cache.blocks_for(total)} KV "
                f"blocks, the pool has {self.total_blocks()}; raise num_blocks or lower "
                "max_new_tokens"
            )
        self._arrivals += 1
        prompt = [operator.index(t) for t in prompt]
        seq = _Seq(rid, prompt, len(prompt), max_new, policy, generator, frozenset(stops),
                   min_new, self._arrivals)  # fmt: skip
        self._seqs[rid] = seq
        leader = self._leaders.get(tuple(prompt))
        if leader is not None and leader.computed < leader.prompt_len and not leader.generated:
            leader.followers.append(seq)
        else:
            self._leaders[tuple(prompt)] = seq
            self._waiting.append(seq)

    def _drop(self, seq: _Seq) -> None:
        """Remove ``seq`` from the engine and free its blocks (its followers stay queued)."""
        del self._seqs[seq.rid]
        key = tuple(seq.tokens[: seq.prompt_len])
        if seq in self._waiting:
            self._waiting.remove(seq)
        elif seq in self._running:
            self._running.remove(seq)
        else:
            for other in self._seqs.values():
                if seq in other.followers:
                    other.followers.remove(seq)
        if self._leaders.get(key) is seq:
            del self._leaders[key]
        if seq.followers:  # the first follower takes over the shared prompt and its blocks
            heir, *rest = seq.followers
            heir.followers, heir.table, heir.slots = rest, seq.table, seq.slots
            heir.computed, seq.table, seq.slots = seq.computed, [], []
            (self._running if heir.computed else self._waiting).append(heir)
            if heir.computed:
                self._running.sort(key=lambda s: s.arrival)
            self._leaders[key] = heir
        self.cache.release(seq.table)

    def _emit(self, seq: _Seq, token: int) -> RequestOutput:
        """Record ``token`` for ``seq`` and finish it if it ended."""
        seq.tokens.append(token)
        reason = None
        if token in seq.stops:  # banned before min_new tokens (``_choose``)
            reason = "stop"
        elif seq.generated >= seq.max_new or len(seq.tokens) >= self.max_model_len:
            reason = "length"
        if reason is not None:
            self._drop(seq)
        return RequestOutput(seq.rid, [token], reason is not None, reason)

    # ---- scheduling ---------------------------------------------------------------------

    def _reserve(self, seq: _Seq, take: int) -> None:
        """Blocks for positions ``computed..computed+take-1`` of ``seq``, private to it."""
        start, end = seq.computed, seq.computed + take
        self.cache.grow(seq.table, end)
        if self.cache.writable(seq.table, start, end):
            seq.slots = self.cache.slots(seq.table, 0, start)

    def _preempt(self, victim: _Seq) -> None:
        """Free ``victim``'s blocks; it waits to be recomputed from its first token."""
        self.num_preemptions += 1
        self._running.remove(victim)
        self.cache.release(victim.table)
        victim.slots, victim.computed = [], 0
        self._waiting.appendleft(victim)

    def _schedule(self) -> tuple[list[_Seq], list[tuple[_Seq, int]]]:
        budget = self.max_tokens_per_step
        decodes: list[_Seq] = []
        chunks: list[tuple[_Seq, int]] = []
        i = 0
        while i < len(self._running) and budget > 0:
            seq = self._running[i]
            take = min(len(seq.tokens) - seq.computed, budget)
            try:
                self._reserve(seq, take)
            except NoFreeBlocks:
                self._preempt(self._running[-1])  # the youngest; maybe ``seq`` itself
                continue
            (decodes.append(seq) if take == 1 and seq.generated else chunks.append((seq, take)))
            budget -= take
            i += 1
        seats = self.max_num_seqs - sum(1 + len(s.followers) for s in self._running)
        while self._waiting and budget > 0 and seats > len(self._waiting[0].followers):
            seq = self._waiting[0]
            take = min(len(seq.tokens) - seq.computed, budget)
            try:
                self._reserve(seq, take)
            except NoFreeBlocks:
                break
            self._waiting.popleft()
            self._running.append(seq)
            chunks.append((seq, take))
            budget -= take
            seats -= 1 + len(seq.followers)
        self._running.sort(key=lambda s: s.arrival)
        return decodes, chunks

    # ---- the forward --------------------------------------------------------------------

    @torch.inference_mode()
    def _forward(
        self, decodes: list[_Seq], chunks: list[tuple[_Seq, int]]
    ) -> list[tuple[_Seq, int]]:
        cache, dev = self.cache, self.runner.device
        ids: list[int] = []
        pos: list[int] = []
        rows: list[list[int]] = []
        for seq in decodes:
            p = seq.computed
            seq.slots.extend(cache.slots(seq.table, p, p + 1))
            ids.append(seq.tokens[p])
            pos.append(p)
            rows.append(seq.slots)
        plan_chunks = []
        last: list[tuple[_Seq, int]] = [(s, i) for i, s in enumerate(decodes)]
        for seq, take in chunks:
            start, end = seq.computed, seq.computed + take
            seq.slots.extend(cache.slots(seq.table, start, end))
            ids.extend(seq.tokens[start:end])
            pos.extend(range(start, end))
            plan_chunks.append((seq.slots, start))
            if end == len(seq.tokens):
                last.append((seq, len(ids) - 1))
        cache.layout = cache.plan(rows, plan_chunks)
        try:
            hidden = self.runner.hidden(
                torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), cache
            )
        finally:
            cache.layout = None
        for seq in decodes:
            seq.computed += 1
        for seq, take in chunks:
            seq.computed += take
        if not last:
            return []
        index = torch.tensor([i for _, i in last], device=dev)
        logits = self.runner.logits(hidden.index_select(0, index)).float()
        produced = []
        chosen = self._plain_choices([s for s, _ in last], logits)
        for j, (seq, _) in enumerate(last):
            token = chosen[j] if j in chosen else self._choose(seq, logits[j : j + 1])
            produced.append((seq, token))
            if seq.computed == seq.prompt_len and seq.followers:
                produced.extend(self._fork(seq, logits[j : j + 1]))
        return produced

    def _plain_choices(self, seqs: list[_Seq], logits: torch.Tensor) -> dict[int, int]:
        """Tokens of the rows without penalty or bans, batched: one argmax over the greedy
        rows; temperature/top-k/top-p once per sampling policy, then each row's draw from its
        own generator (the draws of :func:`next_tokens` on that row alone)."""
        greedy: list[int] = []
        sampled: dict[SamplingPolicy, list[int]] = {}
        for j, seq in enumerate(seqs):
            if seq.policy.repetition_penalty != 1.0 or seq.generated < seq.min_new:
                continue
            if seq.policy.do_sample:
                sampled.setdefault(seq.policy, []).append(j)
            else:
                greedy.append(j)
        chosen = dict(zip(greedy, logits[greedy].argmax(-1).tolist(), strict=True))
        for policy, rows in sampled.items():
            probs = sampling_probs(logits[rows], policy)
            for k, j in enumerate(rows):
                draw = torch.multinomial(probs[k : k + 1], 1, generator=seqs[j].generator)
                chosen[j] = int(draw)
        return chosen

    def _choose(self, seq: _Seq, logits: torch.Tensor) -> int:
        stops = sorted(seq.stops) if seq.generated < seq.min_new else []
        banned = torch.tensor(stops, dtype=torch.long, device=logits.device) if stops else None
        seen = None
        if seq.policy.repetition_penalty != 1.0:
            seen = torch.tensor([seq.tokens], device=logits.device)
        token = next_tokens(logits, seq.policy, seen=seen, banned=banned, generator=seq.generator)
        return int(token[0])

    def _fork(self, leader: _Seq, logits: torch.Tensor) -> list[tuple[_Seq, int]]:
        """The leader's prompt is computed: its followers take its prompt blocks (shared)
        and draw their first token from its last prompt logits."""
        out = []
        followers, leader.followers = leader.followers, []
        key = tuple(leader.tokens[: leader.prompt_len])
        if self._leaders.get(key) is leader:
            del self._leaders[key]
        for seq in followers:
            seq.table = self.cache.fork(leader.table)
            seq.slots, seq.computed = list(leader.slots), leader.computed
            self._running.append(seq)
            out.append((seq, self._choose(seq, logits)))
        return out


def _is_token(t: Any, vocab: int) -> bool:
    """An integer (Python, NumPy or a 0-d tensor) in ``[0, vocab)``."""
    try:
        return not isinstance(t, bool) and 0 <= operator.index(t) < vocab
    except TypeError:
        return False


def _eos_ids(model: nn.Module) -> tuple[int, ...]:
    """The model's EOS ids (its generation_config's, else its config's; none for the GPT)."""
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        value: Any = getattr(source, "eos_token_id", None)
        if value is not None:
            items = [value] if isinstance(value, int) else list(value)
            return tuple(int(v) for v in items)
    return ()
