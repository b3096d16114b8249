"""The decode loop: prefill once, then one token per step against the KV cache.

Every generation path of slipstream runs this loop: ``GPT.generate``, the inference engine
(``slipstream.inference.generation``, which adds the Hugging Face and CUDA-graph drivers and
reads Hugging Face's ``generate`` keywords into a :class:`GenerationRequest`), the RLHF hybrid
engine and VisualChat (a driver that decodes from embeddings). It lives on the models floor so
the reference GPT can use it; what a kind of model must provide is a :class:`ModelDriver`.

:func:`decode_steps` is a generator yielding each step's tokens, so collecting them
(:func:`decode`) and handing them out as they come (streaming) share one loop. Per step it
does the minimum: one model call on the rows still generating, token choice, stop checks.

Finished rows stop costing compute: by default they are dropped from the batch and from the
cache (``finished="drop"``), so a batch whose answers have different lengths shrinks as it
goes; ``finished="mask"`` keeps them in the batch (feeding the pad token), which is what
Hugging Face ``generate`` does. Both give the same tokens (greedy); docs/inference.md has the
measurement that picked the default. Either way a finished row's later columns hold
``pad_token_id`` (a caller that wants the EOS repeated, as VisualChat, makes it the pad).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from slipstream.models import gpt_generation
from slipstream.models.sampling import SamplingPolicy, next_tokens

__all__ = [
    "GPT_DRIVER",
    "FinishedRows",
    "GenerationRequest",
    "ModelDriver",
    "RankSync",
    "decode",
    "decode_steps",
    "generation_request",
]

FinishedRows = Literal["drop", "mask"]


@dataclass(frozen=True)
class GenerationRequest:
    """A validated generation call (prompt rows already expanded for num_return_sequences).

    Built from Hugging Face's ``generate`` keywords by
    :func:`slipstream.inference.request.build_request` at the public boundary, or directly by
    the package's own callers (``GPT.generate``, the RLHF trainers, VisualChat).
    """

    input_ids: torch.Tensor
    """``[b, t]`` prompt token ids, left-padded."""
    attention_mask: torch.Tensor
    """``[b, t]`` 1 for real tokens, 0 for left padding."""
    max_new_tokens: int
    min_new_tokens: int = 0
    sampling: SamplingPolicy = field(default_factory=SamplingPolicy)
    eos_token_ids: tuple[int, ...] = ()
    """Tokens that end a row (empty with ``ignore_eos``)."""
    pad_token_id: int = 0
    """Written after a row has finished."""
    stop_strings: tuple[str, ...] = ()
    tokenizer: Any = None
    generator: torch.Generator | None = None
    streamer: Any = None
    copies: int = 1
    """``num_return_sequences``: consecutive rows ``copies`` of one prompt."""


def generation_request(
    input_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> GenerationRequest:
    """``GPT.generate``'s arguments as a request: no padding, no EOS, ``temperature`` 0 for
    greedy, else sampling at it from the ``top_k`` most likely tokens (None: all).

    Raises:
        ValueError: a negative count or temperature, or ``top_k`` < 1.
    """
    if max_new_tokens < 0 or temperature < 0 or (top_k is not None and top_k < 1):
        raise ValueError(
            f"generate got max_new_tokens={max_new_tokens}, temperature={temperature}, "
            f"top_k={top_k}; need max_new_tokens >= 0, temperature >= 0, top_k >= 1 or None"
        )
    sampling = SamplingPolicy(
        do_sample=temperature > 0, temperature=temperature or 1.0, top_k=top_k or 0
    )
    return GenerationRequest(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        generator=generator,
    )


@dataclass(frozen=True)
class ModelDriver:
    """What the decode loop needs from one kind of model (the GPT's is :data:`GPT_DRIVER`;
    ``slipstream.inference`` has Hugging Face's and the CUDA graph's)."""

    last_logits: Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor, Any], torch.Tensor]
    """Run a chunk against the cache; the last position's logits ``[b, vocab]``."""
    make_cache: Callable[[nn.Module, Any, int], Any]
    select_rows: Callable[[Any, torch.Tensor], None]
    context_length: Callable[[nn.Module], int | None]


GPT_DRIVER = ModelDriver(
    gpt_generation.last_logits,
    gpt_generation.make_cache,
    gpt_generation.select_rows,
    gpt_generation.context_length,
)
"""The reference GPT (its own preallocated KV cache)."""


class RankSync:
    """Keeps the tensor-parallel ranks of one model generating the same tokens.

    ``request`` runs once before the prompt reaches the model (every rank must ask for the
    same thing, and sampling must draw from the same RNG stream); ``tokens`` runs on every
    step's chosen tokens. The default does nothing (one process);
    ``slipstream.inference.parallel`` has the tensor-parallel one.
    """

    def request(self, req: GenerationRequest) -> GenerationRequest:
        return req

    def tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return tokens


ALONE = RankSync()


class _Rows:
    """Bookkeeping of which prompt rows are still generating and where each one is."""

    def __init__(self, req: GenerationRequest) -> None:
        b, t = req.input_ids.shape
        device = req.input_ids.device
        self.out = torch.full((b, t + req.max_new_tokens), req.pad_token_id, device=device)
        self.out[:, :t] = req.input_ids
        self.mask = torch.zeros((b, t + req.max_new_tokens), dtype=torch.long, device=device)
        self.mask[:, :t] = req.attention_mask
        self.live = torch.arange(b, device=device)  # batch row of each cache row
        self.done = torch.zeros(b, dtype=torch.bool, device=device)
        self.length = t  # columns written so far

    def finish(self, rows: torch.Tensor) -> None:
        self.done[rows] = True


def _stopped_by_text(req: GenerationRequest, rows: _Rows, prompt_len: int) -> torch.Tensor:
    """Live rows whose generated text now contains a stop string (decodes only a tail)."""
    window = max(len(s) for s in req.stop_strings) + 2
    hits = []
    for i, row in enumerate(rows.live.tolist()):
        start = max(prompt_len, rows.length - window)
        text = req.tokenizer.decode(rows.out[row, start : rows.length].tolist())
        if any(s in text for s in req.stop_strings):
            hits.append(i)
    return torch.tensor(hits, dtype=torch.long, device=rows.live.device)


def _ended(req: GenerationRequest, rows: _Rows, tokens: torch.Tensor, prompt_len: int) -> Any:
    """Positions (in the live batch) of rows that ended with this step's ``tokens``."""
    ended = torch.zeros_like(tokens, dtype=torch.bool)
    if req.eos_token_ids:
        eos = torch.tensor(req.eos_token_ids, device=tokens.device)
        ended |= torch.isin(tokens, eos)
    if req.stop_strings:
        ended[_stopped_by_text(req, rows, prompt_len)] = True
    return ended


def decode_steps(
    model: nn.Module,
    req: GenerationRequest,
    driver: ModelDriver,
    *,
    cache: Any = "dynamic",
    finished: FinishedRows = "drop",
    all_done: Callable[[bool], bool] | None = None,
    sync: RankSync = ALONE,
) -> Iterator[torch.Tensor]:
    """Yield each step's new tokens ``[batch]`` (the pad token for finished rows).

    Stops after ``req.max_new_tokens`` steps or when every row has ended (EOS, after at
    least ``min_new_tokens``, or a stop string). ``driver`` runs ``model``; ``cache`` is
    handed to its ``make_cache``; ``sync`` makes tensor-parallel ranks agree on each step's
    tokens.

    ``all_done`` keeps processes in lock-step when every model call is a collective (ZeRO-3
    gathering layers as they run): it is called once per step on every process with whether
    this one has finished, and returns whether every process has. A finished process keeps
    making one throw-away model call per step (:func:`_keep_pace`) until all have, so every
    process makes the same number of model calls.
    """
    run = driver
    rows = _Rows(req)
    prompt_len = req.input_ids.shape[1]
    kv = run.make_cache(model, cache, prompt_len + req.max_new_tokens)
    banned = torch.tensor(req.eos_token_ids, dtype=torch.long, device=req.input_ids.device)
    positions = (req.attention_mask.cumsum(1) - 1).clamp(min=0)
    logits = run.last_logits(model, req.input_ids, req.attention_mask, positions, kv)
    next_pos = positions[:, -1:] + 1
    for step in range(req.max_new_tokens):
        live = rows.live
        seen = rows.out[live, : rows.length] if req.sampling.repetition_penalty != 1.0 else None
        tokens = next_tokens(
            logits,
            req.sampling,
            seen=seen,
            banned=banned if step < req.min_new_tokens else None,
            generator=req.generator,
        )
        tokens = sync.tokens(tokens)
        if finished == "mask":
            tokens = torch.where(rows.done[live], req.pad_token_id, tokens)
        rows.out[live, rows.length] = tokens
        rows.mask[live, rows.length] = 1
        rows.length += 1
        ended = _ended(req, rows, tokens, prompt_len) & ~rows.done[live]
        rows.finish(live[ended])
        yield rows.out[:, rows.length - 1]
        if bool(rows.done.all()) or step == req.max_new_tokens - 1:
            if all_done is not None:
                _keep_pace(model, req, all_done, run)
            return
        if all_done is not None:
            all_done(False)
        if finished == "drop" and bool(ended.any()):
            keep = (~ended).nonzero().squeeze(1)
            run.select_rows(kv, keep)
            rows.live, tokens, next_pos = live[keep], tokens[keep], next_pos[keep]
        live = rows.live
        logits = run.last_logits(
            model, tokens.unsqueeze(1), rows.mask[live, : rows.length], next_pos, kv
        )
        next_pos = next_pos + 1


def _keep_pace(
    model: nn.Module, req: GenerationRequest, all_done: Callable[[bool], bool], run: ModelDriver
) -> None:
    """Make one throw-away model call (a 1-token forward, fresh cache) per step until every
    process reports it has finished (``all_done``)."""
    ids = req.input_ids[:, -1:]
    ones, zeros = torch.ones_like(ids), torch.zeros_like(ids)
    while not all_done(True):
        run.last_logits(model, ids, ones, zeros, run.make_cache(model, "dynamic", 1))


@torch.inference_mode()
def decode(
    model: nn.Module, req: GenerationRequest, driver: ModelDriver, **loop: Any
) -> torch.Tensor:
    """Run :func:`decode_steps` (``loop``: its keywords) to the end: ``[batch, prompt + new]``
    token ids, as long as the longest row (rows that ended early are padded with
    ``pad_token_id``). The request's streamer, if any, gets the prompt, then each step's
    tokens, then ``end()``."""
    if req.streamer is not None:
        req.streamer.put(req.input_ids.cpu())
    steps = [req.input_ids]
    for step_tokens in decode_steps(model, req, driver, **loop):
        steps.append(step_tokens.unsqueeze(1).clone())
        if req.streamer is not None:
            req.streamer.put(step_tokens.cpu())
    if req.streamer is not None:
        req.streamer.end()
    return torch.cat(steps, dim=1)


def generate_gpt(
    model: Any,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """:meth:`slipstream.models.gpt.GPT.generate` (its docstring says what it does): the
    decode loop against the GPT's KV cache, then a sliding window past ``max_seq_len``."""
    generation_request(input_ids, max_new_tokens, temperature, top_k, generator)  # checks
    gpt_generation.check_generation_ready(model)
    context = model.config.max_seq_len
    fit = max(0, min(max_new_tokens, context - input_ids.shape[1]))
    if (bad := ((input_ids < 0) | (input_ids >= model.config.vocab_size)).nonzero()).numel():
        raise ValueError(f"generate: input_ids{(at := bad[0].tolist())} = {int(input_ids[tuple(at)])} is not a token "
                         f"of this model (vocabulary of {model.config.vocab_size})")  # fmt: skip
    ids = input_ids
    if fit:
        req = generation_request(ids, fit, temperature, top_k, generator)
        ids = decode(model, req, GPT_DRIVER)
    for _ in range(max_new_tokens - fit):
        # Past the context: each token from the last max_seq_len tokens (a window).
        req = generation_request(ids[:, -context:], 1, temperature, top_k, generator)
        ids = torch.cat([ids, decode(model, req, GPT_DRIVER)[:, -1:]], 1)
    # The loop runs under inference_mode; a copy can enter a training forward after.
    return ids.clone()
