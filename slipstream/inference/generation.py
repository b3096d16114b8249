"""The decode loop: prefill once, then one token per step against the KV cache.

``decode_steps`` is a generator yielding each step's tokens, so :func:`generate` (collect
them) and :func:`stream` (hand them out as they come) share one loop. Per step it does the
minimum: one model call on the rows still generating, token choice, stop checks.

Finished rows stop costing compute: by default they are dropped from the batch and from the
cache (``finished="drop"``), so a batch whose answers have different lengths shrinks as it
goes; ``finished="mask"`` keeps them in the batch (feeding the pad token), which is what
Hugging Face ``generate`` does. Both give the same tokens (greedy); docs/inference.md has the
measurement that picked the default.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from slipstream.config._errors import ConfigError
from slipstream.inference import gpt, graphs, hf
from slipstream.inference.request import GenerationRequest, build_request
from slipstream.inference.sampling import next_tokens
from slipstream.models.gpt import GPT

__all__ = [
    "FinishedRows",
    "ModelDriver",
    "RankSync",
    "decode_steps",
    "driver_for",
    "generate",
    "stream",
]

FinishedRows = Literal["drop", "mask"]


@dataclass(frozen=True)
class ModelDriver:
    """What the decode loop needs from one kind of model (``hf.py``, ``gpt.py``)."""

    last_logits: Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor, Any], torch.Tensor]
    """Run a chunk against the cache; the last position's logits ``[b, vocab]``."""
    make_cache: Callable[[nn.Module, Any, int], Any]
    select_rows: Callable[[Any, torch.Tensor], None]
    context_length: Callable[[nn.Module], int | None]


_HF = ModelDriver(hf.last_logits, hf.make_cache, hf.select_rows, hf.context_length)
_GPT = ModelDriver(gpt.last_logits, gpt.make_cache, gpt.select_rows, gpt.context_length)
_GRAPH = ModelDriver(
    graphs.last_logits, lambda model, _kind, n: graphs.make(model, n), graphs.select_rows,
    hf.context_length,
)  # fmt: skip


def driver_for(model: nn.Module) -> ModelDriver:
    """The driver of ``model``: slipstream's GPT or a Hugging Face causal LM.

    Raises:
        ConfigError: neither (no KV-cache forward slipstream knows how to drive).
    """
    if isinstance(model, GPT):
        gpt.check_generation_ready(model)
        return _GPT
    if hf.is_hf_causal_lm(model):
        return _HF
    raise ConfigError(
        f"generate: {type(model).__name__} is neither slipstream's GPT nor a Hugging Face "
        "causal LM (no can_generate()/config); slipstream's generation path drives those "
        "(GPT, LlamaForCausalLM, GPT2LMHeadModel, ...) through their KV cache"
    )


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


_ALONE = RankSync()


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
    *,
    cache: hf.CacheKind = "dynamic",
    finished: FinishedRows = "drop",
    all_done: Callable[[bool], bool] | None = None,
    driver: ModelDriver | None = None,
    sync: RankSync = _ALONE,
) -> Iterator[torch.Tensor]:
    """Yield each step's new tokens ``[batch]`` (the pad token for finished rows).

    Stops after ``req.max_new_tokens`` steps or when every row has ended (EOS, after at
    least ``min_new_tokens``, or a stop string). ``driver`` defaults to ``driver_for(model)``;
    ``sync`` makes tensor-parallel ranks agree on each step's tokens.

    ``all_done`` keeps processes in lock-step when every model call is a collective (ZeRO-3
    gathering layers as they run): it is called once per step on every process with whether
    this one has finished, and returns whether every process has. A finished process keeps
    making one throw-away model call per step (:func:`_keep_pace`) until all have, so every
    process makes the same number of model calls.
    """
    run = driver if driver is not None else driver_for(model)
    if cache == "graph":
        if run is not _HF or finished != "mask" or all_done is not None:
            raise ConfigError(
                "generate: the CUDA-graph decode step (enable_cuda_graph) drives Hugging Face "
                "causal LMs with finished_rows='mask', one process at a time; got "
                f"{type(model).__name__}, finished={finished!r}"
            )
        run = _GRAPH
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


def _prepare(
    model: nn.Module, kwargs: dict[str, Any], max_out_tokens: int | None, sync: RankSync
) -> tuple[ModelDriver, GenerationRequest]:
    run = driver_for(model)
    req = build_request(
        model, kwargs, max_out_tokens=max_out_tokens, context=run.context_length(model)
    )
    return run, sync.request(req)


@torch.inference_mode()
def generate(
    model: nn.Module,
    *,
    max_out_tokens: int | None = None,
    cache: hf.CacheKind = "dynamic",
    finished: FinishedRows = "drop",
    all_done: Callable[[bool], bool] | None = None,
    sync: RankSync = _ALONE,
    **kwargs: Any,
) -> torch.Tensor:
    """Hugging Face ``model.generate`` semantics: ``[batch, prompt + new]`` token ids.

    Takes HF's keywords (``input_ids``, ``attention_mask``, ``max_new_tokens``,
    ``min_new_tokens``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``,
    ``repetition_penalty``, ``eos_token_id``, ``pad_token_id``, ``stop_strings`` with
    ``tokenizer``, ``num_return_sequences``, ``streamer``) plus ``ignore_eos`` and
    ``seed`` / ``generator`` for reproducible sampling. Rows that end early are padded with
    ``pad_token_id``; the result is as long as the longest row (HF does the same).
    ``all_done`` keeps processes in lock-step (see :func:`decode_steps`).

    Raises:
        ConfigError: before any model work, for every invalid request (see ``request.py``).
    """
    run, req = _prepare(model, kwargs, max_out_tokens, sync)
    if req.streamer is not None:
        req.streamer.put(req.input_ids.cpu())
    steps = [req.input_ids]
    for step_tokens in decode_steps(
        model, req, cache=cache, finished=finished, all_done=all_done, driver=run, sync=sync
    ):
        steps.append(step_tokens.unsqueeze(1).clone())
        if req.streamer is not None:
            req.streamer.put(step_tokens.cpu())
    if req.streamer is not None:
        req.streamer.end()
    return torch.cat(steps, dim=1)


def stream(
    model: nn.Module,
    *,
    max_out_tokens: int | None = None,
    cache: hf.CacheKind = "dynamic",
    finished: FinishedRows = "drop",
    sync: RankSync = _ALONE,
    **kwargs: Any,
) -> Iterator[torch.Tensor]:
    """Like :func:`generate`, but yield each step's tokens ``[batch]`` as they are produced.

    The arguments are validated when this is called, before the first token is asked for.
    Concatenating the yielded tensors gives ``generate(...)[:, prompt_len:]``.
    """
    run, req = _prepare(model, kwargs, max_out_tokens, sync)

    def steps() -> Iterator[torch.Tensor]:
        with torch.inference_mode():
            for tokens in decode_steps(
                model, req, cache=cache, finished=finished, driver=run, sync=sync
            ):
                yield tokens.clone()

    return steps()
