"""Generation for the inference engine: Hugging Face's ``generate`` keywords in, the decode loop
of :mod:`slipstream.models.decoding` run on the model's driver.

The loop itself (prefill, one token per step against the KV cache, finished rows dropped or
masked) is on the models floor, shared with ``GPT.generate``; this module adds the drivers of
Hugging Face causal LMs (``hf.py``) and of the CUDA-graph decode step (``graphs.py``), picks
one for a model (:func:`driver_for`), and reads the keywords once (:func:`generate`,
:func:`stream`); callers inside the package that already hold a typed
:class:`~slipstream.models.decoding.GenerationRequest` use :func:`run`.

``init_inference(...).generate`` runs on the continuous-batching engine
(``paged_generate.generate_auto``: every row a request on the paged KV cache, LLaMA-family projections
fused and pre-packed on the CPU) where that applies: ``kv_cache="auto"`` (the engine's
default) picks it for greedy requests of a model the paged forward drives, on one process
or a tensor-parallel group, with finished rows dropped and no streamer or stop strings;
everything else (sampling, whose draws are HF ``generate``'s only here, expert parallelism,
``finished_rows="mask"``, ...) runs the static loop below, as
``kv_cache="dynamic"`` always does. ``kv_cache="paged"`` asks for the paged engine and
refuses a request it cannot run, naming why.

Finished rows stop costing compute: by default they are dropped from the batch and from the
cache (``finished="drop"``); ``finished="mask"`` keeps them in the batch (feeding the pad
token), which is what Hugging Face ``generate`` does. Both give the same tokens (greedy);
docs/inference.md has the measurement that picked the default.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
from torch import nn

from slipstream.config._errors import ConfigError
from slipstream.inference import graphs, hf
from slipstream.inference.request import build_request
from slipstream.models.decoding import (
    ALONE,
    GPT_DRIVER,
    FinishedRows,
    GenerationRequest,
    ModelDriver,
    RankSync,
    decode,
    decode_steps,
)
from slipstream.models.gpt import GPT
from slipstream.models.gpt_generation import check_generation_ready

__all__ = [
    "CacheChoice",
    "FinishedRows",
    "ModelDriver",
    "RankSync",
    "driver_for",
    "generate",
    "prepare",
    "run",
    "stream",
]

CacheChoice = Literal["auto", "paged", "dynamic", "static", "graph"]

_HF = ModelDriver(hf.last_logits, hf.make_cache, hf.select_rows, hf.context_length)
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
        check_generation_ready(model)
        return GPT_DRIVER
    if hf.is_hf_causal_lm(model):
        return _HF
    raise ConfigError(
        f"generate: {type(model).__name__} is neither slipstream's GPT nor a Hugging Face "
        "causal LM (no can_generate()/config); slipstream's generation path drives those "
        "(GPT, LlamaForCausalLM, GPT2LMHeadModel, ...) through their KV cache"
    )


def _driver(model: nn.Module, cache: hf.CacheKind, finished: FinishedRows, lockstep: bool) -> Any:
    run = driver_for(model)
    if cache == "graph":
        if run is not _HF or finished != "mask" or lockstep:
            raise ConfigError(
                "generate: the CUDA-graph decode step (enable_cuda_graph) drives Hugging Face "
                "causal LMs with finished_rows='mask', one process at a time; got "
                f"{type(model).__name__}, finished={finished!r}"
            )
        return _GRAPH
    return run


def prepare(
    model: nn.Module, kwargs: dict[str, Any], max_out_tokens: int | None, sync: RankSync
) -> GenerationRequest:
    req = build_request(
        model,
        kwargs,
        max_out_tokens=max_out_tokens,
        context=driver_for(model).context_length(model),
    )
    return sync.request(req)


def run(
    model: nn.Module,
    req: GenerationRequest,
    *,
    cache: CacheChoice = "dynamic",
    finished: FinishedRows = "drop",
    all_done: Callable[[bool], bool] | None = None,
    sync: RankSync = ALONE,
) -> torch.Tensor:
    """Decode a typed request on ``model`` (a GPT or a Hugging Face causal LM) with the static
    loop: ``[batch, prompt + new]`` token ids. ``all_done`` keeps processes in lock-step (see
    :func:`~slipstream.models.decoding.decode_steps`). ``cache`` "auto" and "paged" mean
    "dynamic" here: the choice of the continuous-batching engine is made by
    ``paged_generate.generate_auto`` (``init_inference(...).generate``).
    """
    kind: hf.CacheKind = "dynamic" if cache in ("auto", "paged") else cache  # type: ignore[assignment]
    run_ = _driver(model, kind, finished, all_done is not None)
    return decode(model, req, run_, cache=kind, finished=finished, all_done=all_done, sync=sync)


def generate(
    model: nn.Module,
    *,
    max_out_tokens: int | None = None,
    cache: CacheChoice = "dynamic",
    finished: FinishedRows = "drop",
    all_done: Callable[[bool], bool] | None = None,
    sync: RankSync = ALONE,
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
    req = prepare(model, kwargs, max_out_tokens, sync)
    return run(model, req, cache=cache, finished=finished, all_done=all_done, sync=sync)


def stream(
    model: nn.Module,
    *,
    max_out_tokens: int | None = None,
    cache: CacheChoice = "dynamic",
    finished: FinishedRows = "drop",
    sync: RankSync = ALONE,
    **kwargs: Any,
) -> Iterator[torch.Tensor]:
    """Like :func:`generate`, but yield each step's tokens ``[batch]`` as they are produced.

    The arguments are validated when this is called, before the first token is asked for.
    Concatenating the yielded tensors gives ``generate(...)[:, prompt_len:]``.
    """
    if cache == "paged":
        raise ConfigError(
            "stream: kv_cache='paged' does not stream (the continuous-batching engine streams "
            "through slipstream.inference.ContinuousBatchingEngine.step); use kv_cache='auto' "
            "or 'dynamic'"
        )
    kind: hf.CacheKind = "dynamic" if cache == "auto" else cache  # type: ignore[assignment]
    req = prepare(model, kwargs, max_out_tokens, sync)
    run_ = _driver(model, kind, finished, False)

    def steps() -> Iterator[torch.Tensor]:
        with torch.inference_mode():
            for tokens in decode_steps(model, req, run_, cache=kind, finished=finished, sync=sync):
                yield tokens.clone()

    return steps()
