"""Static batching behind the step interface: today's decode loop, one batch at a time.

:class:`StaticBatchingEngine` serves requests with the decode loop every generation path of
slipstream runs (:func:`slipstream.models.decoding.decode_steps`: prefill, then one token per
step against the KV cache, finished rows dropped). When no batch runs, it takes up to
``max_num_seqs`` waiting requests that decode alike (same sampling settings and stop tokens),
left-pads them into one batch and runs it to the end, one token per :meth:`step`; requests
that arrive meanwhile wait for the next batch. That is static batching: a batch is fixed at
its prompt, its rows finish at different steps and are not replaced. It is the baseline the
continuous batching engine is measured against (``benchmarks/serve.py``) and the backend of
``slipstream serve`` where that engine is not available.

A "block" here is a batch slot: ``total_blocks()`` is ``max_num_seqs``; a running batch holds
one slot per row until the whole batch ends.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from slipstream.config._errors import ConfigError
from slipstream.inference.generation import driver_for
from slipstream.inference.serving.protocol import RequestOutput, SamplingParams
from slipstream.models.decoding import GenerationRequest, decode_steps
from slipstream.models.sampling import SamplingPolicy

__all__ = ["StaticBatchingEngine", "model_eos_ids"]


def model_eos_ids(model: nn.Module) -> tuple[int, ...]:
    """The EOS tokens of ``model``: its generation_config's, else its config's (may be none)."""
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            return (eos,) if isinstance(eos, int) else tuple(int(e) for e in eos)
    return ()


def _vocab_size(model: nn.Module) -> int:
    """Rows of the output layer (a GPT's or a Hugging Face model's)."""
    head: Any = getattr(model, "get_output_embeddings", None)
    if callable(head) and head() is not None:
        return int(head().weight.shape[0])
    return int(getattr(model, "config").vocab_size)  # noqa: B009


def _policy(params: SamplingParams) -> SamplingPolicy:
    return SamplingPolicy(
        do_sample=params.do_sample,
        temperature=params.temperature,
        top_k=params.top_k or 0,
        top_p=1.0 if params.top_p is None else params.top_p,
    )


def _batch_key(params: SamplingParams) -> tuple[Any, ...]:
    """Requests with equal keys decode alike, so they can share a batch. A seeded sampled
    request gets a key of its own (``id``): its draws must not depend on its batch mates."""
    stops = (params.ignore_eos, tuple(params.stop_token_ids))
    if not params.do_sample:
        return (False, *stops)
    if params.seed is not None:
        return (True, id(params))
    return (True, params.temperature, params.top_k, params.top_p, *stops)


@dataclass
class _Row:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    produced: int = 0
    done: bool = False


class _Batch:
    """One running batch: its rows and the decode loop's generator."""

    def __init__(self, rows: list[_Row], steps: Iterator[torch.Tensor]) -> None:
        self.rows = rows
        self.steps = steps

    def close(self) -> None:
        close = getattr(self.steps, "close", None)
        if close is not None:
            close()


class StaticBatchingEngine:
    """The :class:`~slipstream.inference.serving.protocol.GenerationEngine` interface over the
    static decode loop (see the module docstring).

    Args:
        model: a Hugging Face causal LM or slipstream's GPT (eval mode, on its device).
        max_num_seqs: rows of one batch at most (also ``total_blocks()``).
        max_model_len: prompt plus new tokens of one request at most; default the model's
            context length.
        eos_token_ids: tokens that end a request; default the model's (generation_config).
        pad_token_id: the left-padding token; default the model's pad, else its first EOS, else 0.

    Raises:
        ConfigError: the model is neither a GPT nor a Hugging Face causal LM, ``max_num_seqs``
            < 1, or no context length is known and ``max_model_len`` is not given.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        max_num_seqs: int = 8,
        max_model_len: int | None = None,
        eos_token_ids: tuple[int, ...] | None = None,
        pad_token_id: int | None = None,
    ) -> None:
        self._driver = driver_for(model)
        context = self._driver.context_length(model)
        if max_num_seqs < 1:
            raise ConfigError(f"StaticBatchingEngine: max_num_seqs={max_num_seqs}; use >= 1")
        if max_model_len is None and context is None:
            raise ConfigError(
                f"StaticBatchingEngine: {type(model).__name__} states no context length; "
                "pass max_model_len"
            )
        self.model = model
        self.max_num_seqs = max_num_seqs
        self.max_model_len = int(max_model_len or context or 0)
        self.eos_token_ids = model_eos_ids(model) if eos_token_ids is None else eos_token_ids
        pad = getattr(getattr(model, "config", None), "pad_token_id", None)
        fallback = self.eos_token_ids[0] if self.eos_token_ids else 0
        self.pad_token_id = int(pad_token_id if pad_token_id is not None else pad or fallback)
        self.vocab_size = _vocab_size(model)
        self._device = next(model.parameters()).device
        self._waiting: deque[_Row] = deque()
        self._batch: _Batch | None = None

    # -- the interface ------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """Queue a request for the next batch.

        Raises:
            ValueError: a duplicate id, an empty prompt, a token outside the vocabulary,
                ``max_new_tokens`` < 1, prompt plus ``max_new_tokens`` past ``max_model_len``,
                or invalid sampling settings.
        """
        if self._known(request_id):
            raise ValueError(f"request {request_id!r} is already queued or running")
        if not prompt_ids:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"request {request_id!r}: token {bad[0]} is not in the vocabulary "
                f"(0..{self.vocab_size - 1})"
            )
        if params.max_new_tokens < 1:
            raise ValueError(f"request {request_id!r}: max_new_tokens={params.max_new_tokens}")
        if len(prompt_ids) + params.max_new_tokens > self.max_model_len:
            raise ValueError(
                f"request {request_id!r}: {len(prompt_ids)} prompt tokens + "
                f"{params.max_new_tokens} new tokens > max_model_len {self.max_model_len}"
            )
        try:
            _policy(params)
        except ConfigError as err:
            raise ValueError(f"request {request_id!r}: {err}") from err
        self._waiting.append(_Row(request_id, list(prompt_ids), params))

    def abort(self, request_id: str) -> None:
        """Drop a waiting request, or stop reporting a running one (its row keeps its batch
        slot until the batch ends; a batch whose rows are all done stops at once)."""
        for row in self._waiting:
            if row.request_id == request_id:
                self._waiting.remove(row)
                return
        if self._batch is not None:
            for row in self._batch.rows:
                if row.request_id == request_id:
                    row.done = True
            self._end_if_done()

    def step(self) -> list[RequestOutput]:
        """One token for every row of the running batch (starting a batch first if none
        runs: its first step is the prefill)."""
        if self._batch is None and not self._start_batch():
            return []
        assert self._batch is not None
        with torch.inference_mode():
            tokens = next(self._batch.steps, None)
        outputs = []
        values = tokens.tolist() if tokens is not None else [None] * len(self._batch.rows)
        for row, token in zip(self._batch.rows, values, strict=True):
            if row.done:
                continue
            out = self._advance(row, token)
            if out is not None:
                outputs.append(out)
        self._end_if_done()
        return outputs

    def has_unfinished(self) -> bool:
        return bool(self._waiting) or self._batch is not None

    def free_blocks(self) -> int:
        return self.max_num_seqs - (len(self._batch.rows) if self._batch is not None else 0)

    def total_blocks(self) -> int:
        return self.max_num_seqs

    # -- batches ---------------------------------------------------------------------------

    def _known(self, request_id: str) -> bool:
        rows = list(self._waiting) + (self._batch.rows if self._batch is not None else [])
        return any(r.request_id == request_id and not r.done for r in rows)

    def _advance(self, row: _Row, token: int | None) -> RequestOutput | None:
        if token is None:  # the loop ended first (cannot happen: it runs the longest row)
            row.done = True
            return RequestOutput(row.request_id, [], True, "length")
        row.produced += 1
        stops = set(row.params.stop_token_ids)
        if not row.params.ignore_eos:
            stops |= set(self.eos_token_ids)
        reason = "stop" if token in stops else None
        if reason is None and row.produced >= row.params.max_new_tokens:
            reason = "length"
        row.done = reason is not None
        return RequestOutput(row.request_id, [token], row.done, reason)

    def _end_if_done(self) -> None:
        if self._batch is not None and all(r.done for r in self._batch.rows):
            self._batch.close()
            self._batch = None

    def _start_batch(self) -> bool:
        if not self._waiting:
            return False
        key = _batch_key(self._waiting[0].params)
        rows = [r for r in self._waiting if _batch_key(r.params) == key][: self.max_num_seqs]
        for row in rows:
            self._waiting.remove(row)
        self._batch = _Batch(rows, self._decode(rows))
        return True

    def _decode(self, rows: list[_Row]) -> Iterator[torch.Tensor]:
        params = rows[0].params
        width = max(len(r.prompt_ids) for r in rows)
        ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, row in enumerate(rows):
            ids[i, width - len(row.prompt_ids) :] = torch.tensor(row.prompt_ids)
            mask[i, width - len(row.prompt_ids) :] = 1
        eos = () if params.ignore_eos else self.eos_token_ids
        generator = None
        if params.do_sample and params.seed is not None:
            generator = torch.Generator(self._device).manual_seed(params.seed)
        req = GenerationRequest(
            input_ids=ids.to(self._device),
            attention_mask=mask.to(self._device),
            max_new_tokens=max(r.params.max_new_tokens for r in rows),
            sampling=_policy(params),
            eos_token_ids=tuple(dict.fromkeys((*eos, *params.stop_token_ids))),
            pad_token_id=self.pad_token_id,
            generator=generator,
        )
        return decode_steps(self.model, req, self._driver)
