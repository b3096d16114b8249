"""``generate``'s arguments (Hugging Face ``model.generate``'s names), checked before any work.

The one place Hugging Face's keywords are read: the public ``generate`` methods (the inference
engine's, :func:`slipstream.inference.generate`, the hybrid engine's ``engine.generate``)
pass their call through :func:`call_arguments` and :func:`build_request`; everything inside
the package hands the resulting typed :class:`GenerationRequest` around.

Values the caller leaves out come from the model's ``generation_config`` and then from
Hugging Face's defaults (``max_length`` 20, ``top_k`` 50 when sampling), so a call written
for ``model.generate`` picks the same settings here. Every check that can fail runs here,
before the prompt reaches the model: a request that cannot finish is refused, not cut short.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from slipstream.config._errors import ConfigError, did_you_mean
from slipstream.models.decoding import GenerationRequest
from slipstream.models.sampling import SamplingPolicy

__all__ = [
    "GENERATE_ARGUMENTS",
    "GenerationRequest",
    "build_request",
    "call_arguments",
    "check_length",
    "trainer_request",
]

# HF's global defaults for values neither the call nor generation_config sets.
_HF_DEFAULTS: dict[str, Any] = {
    "max_length": 20,
    "do_sample": False,
    "temperature": 1.0,
    "top_k": 50,
    "top_p": 1.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "num_beams": 1,
    "num_return_sequences": 1,
}

GENERATE_ARGUMENTS = (
    "input_ids", "inputs", "attention_mask", "generation_config", "max_new_tokens",
    "max_length", "min_new_tokens", "min_length", "do_sample", "temperature", "top_k",
    "top_p", "repetition_penalty", "eos_token_id", "pad_token_id", "bos_token_id",
    "stop_strings", "tokenizer", "ignore_eos", "seed", "generator", "streamer", "num_beams",
    "num_return_sequences", "use_cache", "return_dict_in_generate", "output_scores",
    "output_logits", "synced_gpus",
)  # fmt: skip
"""Every keyword ``generate`` understands; anything else is refused with a did-you-mean."""


def _pick(kwargs: dict[str, Any], gen_config: Any, name: str) -> Any:
    """The call's value, else the model's generation_config's, else HF's default."""
    if kwargs.get(name) is not None:
        return kwargs[name]
    value = getattr(gen_config, name, None) if gen_config is not None else None
    return value if value is not None else _HF_DEFAULTS.get(name)


def _check_names(kwargs: dict[str, Any]) -> None:
    for name in kwargs:
        if name not in GENERATE_ARGUMENTS:
            hint = did_you_mean(name, GENERATE_ARGUMENTS)
            raise ConfigError(
                f"generate: unknown argument {name!r}"
                + (f"; did you mean {hint!r}?" if hint else "")
                + f" (accepted: {', '.join(sorted(GENERATE_ARGUMENTS))})"
            )


def _refuse_unsupported(kwargs: dict[str, Any], gen_config: Any) -> None:
    beams = _pick(kwargs, gen_config, "num_beams")
    if beams != 1:
        raise ConfigError(
            f"generate: num_beams={beams} is not supported (slipstream generates with greedy "
            "search or sampling); use num_beams=1, or do_sample=True with "
            "num_return_sequences=N for several candidates"
        )
    for name in ("return_dict_in_generate", "output_scores", "output_logits"):
        if kwargs.get(name):
            raise ConfigError(
                f"generate: {name}=True is not supported; generate returns the token ids "
                "(prompt included). Compute scores with a forward pass over the result"
            )
    if kwargs.get("use_cache") is False:
        raise ConfigError(
            "generate: use_cache=False is not supported (slipstream always decodes with a KV "
            "cache; the output is the same); drop the argument"
        )


def _prompt(kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    ids = kwargs.get("input_ids", kwargs.get("inputs"))
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype != torch.long:
        got = f"{tuple(ids.shape)} {ids.dtype}" if isinstance(ids, torch.Tensor) else type(ids)
        raise ConfigError(
            f"generate: input_ids must be a [batch, length] torch.long tensor, got {got}; "
            "use tokenizer(..., return_tensors='pt').input_ids"
        )
    if ids.shape[1] == 0:
        raise ConfigError("generate: input_ids has no tokens; give at least one prompt token")
    mask = kwargs.get("attention_mask")
    if mask is None:
        return ids, torch.ones_like(ids)
    if not isinstance(mask, torch.Tensor) or mask.shape != ids.shape:
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask)
        raise ConfigError(
            f"generate: attention_mask {shape} must have input_ids' shape {tuple(ids.shape)}"
        )
    mask = mask.to(torch.long)
    if ((mask != 0) & (mask != 1)).any():
        raise ConfigError("generate: attention_mask must hold only 0 (padding) and 1 (tokens)")
    if (mask.sum(1) == 0).any():
        row = int((mask.sum(1) == 0).nonzero()[0])
        raise ConfigError(f"generate: prompt row {row} is all padding; give it a token")
    right_padded = (mask[:, 1:] < mask[:, :-1]).any(dim=1)
    if right_padded.any():
        row = int(right_padded.nonzero()[0])
        raise ConfigError(
            f"generate: prompt row {row} is right-padded (a 0 after a 1 in attention_mask); "
            "decoder-only models need left padding: set tokenizer.padding_side = 'left'"
        )
    return ids, mask


def _token_ids(value: Any, name: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, torch.Tensor):
        value = value.flatten().tolist()
    items = [value] if isinstance(value, int) else list(value)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in items):
        raise ConfigError(f"generate: {name}={value!r} must be a token id or a list of them")
    return tuple(items)


def _budget(kwargs: dict[str, Any], gen_config: Any, prompt_len: int) -> tuple[int, int]:
    """(max_new_tokens, min_new_tokens) from HF's max_/min_ new_tokens / length arguments."""
    new = kwargs.get("max_new_tokens")
    if new is None and kwargs.get("max_length") is None:
        new = getattr(gen_config, "max_new_tokens", None)
    if new is None:
        new = int(_pick(kwargs, gen_config, "max_length")) - prompt_len
    low = kwargs.get("min_new_tokens")
    if low is None and kwargs.get("min_length") is not None:
        low = int(kwargs["min_length"]) - prompt_len
    if low is None:
        low = _pick(kwargs, gen_config, "min_new_tokens")
    if not isinstance(new, int) or new < 1:
        raise ConfigError(
            f"generate: {new!r} new tokens requested (prompt is {prompt_len} tokens); set "
            "max_new_tokens >= 1 (max_length counts the prompt too)"
        )
    if not isinstance(low, int) or not 0 <= low <= new:
        raise ConfigError(f"generate: min_new_tokens={low!r} must be in [0, {new}]")
    return new, max(low, 0)


def call_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``generate(*args, **kwargs)`` as keywords: the prompt ids may come first by position
    (or as ``inputs=``, Hugging Face's name).

    Raises:
        ConfigError: more than one positional argument, or the prompt given twice.
    """
    if len(args) > 1:
        raise ConfigError(
            "generate takes the prompt ids as its only positional argument; pass the rest "
            "by keyword (attention_mask=..., max_new_tokens=...)"
        )
    if args:
        if "input_ids" in kwargs or "inputs" in kwargs:
            raise ConfigError("generate: input_ids given both by position and by keyword")
        kwargs = {"input_ids": args[0], **kwargs}
    return kwargs


def check_length(req: GenerationRequest, max_out_tokens: int | None, context: int | None) -> None:
    """Refuse a request whose prompt plus new tokens exceeds ``max_out_tokens`` (the engine's
    limit) or ``context`` (the model's positions)."""
    _check_length(req.input_ids.shape[1] + req.max_new_tokens, max_out_tokens, context)


def _check_length(total: int, max_out_tokens: int | None, context: int | None) -> None:
    if max_out_tokens is not None and total > max_out_tokens:
        raise ConfigError(
            f"generate: prompt plus new tokens is {total} tokens, more than max_out_tokens="
            f"{max_out_tokens}; shorten the prompt, lower max_new_tokens, or raise "
            "max_out_tokens in init_inference"
        )
    if context is not None and total > context:
        raise ConfigError(
            f"generate: prompt plus new tokens is {total} tokens, more than the model's "
            f"context of {context} positions; shorten the prompt or lower max_new_tokens"
        )


def _generator(kwargs: dict[str, Any], device: torch.device) -> torch.Generator | None:
    gen, seed = kwargs.get("generator"), kwargs.get("seed")
    if gen is not None and seed is not None:
        raise ConfigError("generate: give either seed or generator, not both")
    if seed is not None:
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ConfigError(f"generate: seed={seed!r} must be an int")
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
    return gen


def check_token_ids(ids: torch.Tensor, vocab_size: int | None, what: str = "generate") -> None:
    """Refuse a token id outside ``[0, vocab_size)`` before any work (the embedding would
    raise a bare ``IndexError``), naming the first bad id and where it is."""
    if vocab_size is None or ids.numel() == 0:
        return
    bad = (ids < 0) | (ids >= vocab_size)
    if bool(bad.any()):
        row, col = (int(i) for i in bad.nonzero()[0])
        raise ConfigError(
            f"{what}: input_ids[{row}, {col}] = {int(ids[row, col])} is not a token of this "
            f"model (vocabulary of {vocab_size}: ids 0..{vocab_size - 1}); was the prompt "
            "encoded with another model's tokenizer?"
        )


def _vocab_size(model: nn.Module) -> int | None:
    embed = getattr(model, "get_input_embeddings", None)
    layer = embed() if callable(embed) else None
    if isinstance(layer, nn.Embedding):
        return int(layer.num_embeddings)
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    return size if isinstance(size, int) else None


def build_request(
    model: nn.Module,
    kwargs: dict[str, Any],
    *,
    max_out_tokens: int | None = None,
    context: int | None = None,
) -> GenerationRequest:
    """Validate ``generate(**kwargs)`` for ``model`` and resolve every default.

    Raises:
        ConfigError: an unknown argument, a bad value, an unsupported mode (beam search), or
            a prompt plus new tokens longer than ``max_out_tokens`` or the model's context.
    """
    _check_names(kwargs)
    gen_config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    _refuse_unsupported(kwargs, gen_config)
    ids, mask = _prompt(kwargs)
    check_token_ids(ids, _vocab_size(model))
    new, low = _budget(kwargs, gen_config, ids.shape[1])
    _check_length(ids.shape[1] + new, max_out_tokens, context)
    sampling = SamplingPolicy(
        do_sample=bool(_pick(kwargs, gen_config, "do_sample")),
        temperature=float(_pick(kwargs, gen_config, "temperature")),
        top_k=int(_pick(kwargs, gen_config, "top_k")),
        top_p=float(_pick(kwargs, gen_config, "top_p")),
        repetition_penalty=float(_pick(kwargs, gen_config, "repetition_penalty")),
    )
    eos = _token_ids(_pick(kwargs, gen_config, "eos_token_id"), "eos_token_id")
    pad = _token_ids(_pick(kwargs, gen_config, "pad_token_id"), "pad_token_id")
    stops = kwargs.get("stop_strings") or ()
    stops = (stops,) if isinstance(stops, str) else tuple(stops)
    if stops and kwargs.get("tokenizer") is None:
        raise ConfigError(
            f"generate: stop_strings={list(stops)} need the tokenizer to read the text; pass "
            "tokenizer=..."
        )
    copies = int(_pick(kwargs, gen_config, "num_return_sequences"))
    if copies < 1:
        raise ConfigError(f"generate: num_return_sequences={copies} must be >= 1")
    return GenerationRequest(
        input_ids=ids.repeat_interleave(copies, 0),
        attention_mask=mask.to(ids.device).repeat_interleave(copies, 0),
        max_new_tokens=new,
        min_new_tokens=low,
        sampling=sampling,
        eos_token_ids=() if kwargs.get("ignore_eos") else eos,
        pad_token_id=pad[0] if pad else (eos[0] if eos else 0),
        stop_strings=stops,
        tokenizer=kwargs.get("tokenizer"),
        generator=_generator(kwargs, ids.device),
        streamer=kwargs.get("streamer"),
        copies=copies,
    )


def trainer_request(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    do_sample: bool,
    temperature: float,
    top_k: int | None,
    eos_token_ids: list[int],
    pad_token_id: int,
    seed: int,
) -> GenerationRequest:
    """The request of an RLHF trainer's generation (PPO, GRPO): its own settings, the rest
    (``top_k`` when None, ``top_p``, ``repetition_penalty``) from ``model``'s
    ``generation_config`` and Hugging Face's defaults, as ``model.generate`` would take them.
    """
    return build_request(
        model,
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "max_new_tokens": max_new_tokens,
            "do_sample": do_sample,
            "temperature": temperature,
            "top_k": top_k,
            "seed": seed,
            "pad_token_id": pad_token_id,
            "eos_token_id": eos_token_ids,
        },
    )
