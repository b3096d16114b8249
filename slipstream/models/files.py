"""Models on disk: the reference GPT's one format, and the one Hugging Face loader.

A reference GPT directory holds ``gpt_config.json`` (the :class:`~slipstream.models.gpt.GPTConfig`
fields), ``model.safetensors`` (its ``state_dict``) and, when it was trained on text with a
toy tokenizer, ``tokenizer.json`` (``{"type": "char", "chars": ...}`` or ``{"type": "byte"}``;
none means UTF-8 bytes). ``slipstream chat`` writes it, ``slipstream quant eval`` and
``slipstream generate`` read it. The layout ``slipstream chat`` wrote before
(``slipstream_gpt.json`` + ``model.pt``) is still read.

Hugging Face models and tokenizers load through :func:`load_hf_model` and
:func:`load_hf_tokenizer`: local files only (no hub), a dtype, and a tokenizer without a pad
token gets its EOS as pad (as DeepSpeed-Chat does).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from slipstream.config._errors import ConfigError
from slipstream.data.tokenizer import ByteTokenizer, CharTokenizer, TextTokenizer
from slipstream.models.gpt import GPT, GPTConfig

__all__ = [
    "GPT_CONFIG_FILE",
    "LEGACY_GPT_FILE",
    "TOKENIZER_FILE",
    "WEIGHTS_FILE",
    "is_gpt_dir",
    "legacy_meta",
    "load_gpt",
    "load_gpt_config",
    "load_gpt_state",
    "load_hf_model",
    "load_hf_tokenizer",
    "load_tokenizer",
    "save_gpt",
    "save_tokenizer",
]

GPT_CONFIG_FILE = "gpt_config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"
LEGACY_GPT_FILE = "slipstream_gpt.json"
"""``slipstream chat``'s earlier layout: ``{"config": {...}, "reward": bool}`` + ``model.pt``."""
_LEGACY_WEIGHTS = "model.pt"


def is_gpt_dir(path: str | Path) -> bool:
    """Whether ``path`` is a saved reference GPT (this format or the earlier one)."""
    path = Path(path)
    return (path / GPT_CONFIG_FILE).is_file() or (path / LEGACY_GPT_FILE).is_file()


def legacy_meta(path: Path) -> dict[str, Any] | None:
    """The earlier layout's ``slipstream_gpt.json``, or None for this format."""
    if (path / GPT_CONFIG_FILE).is_file() or not (path / LEGACY_GPT_FILE).is_file():
        return None
    meta: dict[str, Any] = json.loads((path / LEGACY_GPT_FILE).read_text(encoding="utf-8"))
    return meta


def load_gpt_config(path: str | Path) -> GPTConfig:
    """The :class:`GPTConfig` of a saved GPT.

    Raises:
        ConfigError: ``path`` is not a saved GPT.
    """
    path = Path(path)
    meta = legacy_meta(path)
    if meta is not None:
        return GPTConfig(**meta["config"])
    if not (path / GPT_CONFIG_FILE).is_file():
        raise ConfigError(
            f"{path} is not a saved slipstream GPT: no {GPT_CONFIG_FILE} (the GPTConfig "
            f"fields) beside {WEIGHTS_FILE}"
        )
    return GPTConfig(**json.loads((path / GPT_CONFIG_FILE).read_text(encoding="utf-8")))


def load_gpt_state(path: str | Path) -> dict[str, torch.Tensor]:
    """The saved tensors of a GPT directory (``model.safetensors``, or the earlier
    ``model.pt``)."""
    path = Path(path)
    if legacy_meta(path) is not None:
        state: dict[str, torch.Tensor] = torch.load(path / _LEGACY_WEIGHTS, weights_only=True)
        return state
    from safetensors.torch import load_file

    return load_file(str(path / WEIGHTS_FILE))


def load_gpt(path: str | Path) -> GPT:
    """The saved GPT at ``path`` (train mode, as a new module; call ``eval()`` to infer).

    Raises:
        ConfigError: not a GPT directory, or one holding a reward model (its LM head was
            dropped).
    """
    path = Path(path)
    meta = legacy_meta(path)
    if (meta is not None and meta.get("reward")) or (path / "v_head.pt").is_file():
        raise ConfigError(
            f"{path} holds a reward model (a value head instead of the LM head), not a "
            "language model; use step 1's or step 3's actor directory"
        )
    model = GPT(load_gpt_config(path))
    model.load_state_dict(load_gpt_state(path), strict=True)
    return model


def save_gpt(
    config: GPTConfig,
    state: dict[str, torch.Tensor],
    directory: str | Path,
    tokenizer: TextTokenizer | None = None,
) -> None:
    """Write a GPT (``config`` and whole ``state`` tensors, e.g. a gathered state dict) and
    its toy tokenizer to ``directory`` (created)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / GPT_CONFIG_FILE).write_text(json.dumps(asdict(config), indent=1))
    # Tied weights are one tensor twice; safetensors stores each name's own copy.
    save_file({k: v.detach().cpu().contiguous().clone() for k, v in state.items()},
              str(directory / WEIGHTS_FILE))  # fmt: skip
    if tokenizer is not None:
        save_tokenizer(tokenizer, directory)


def save_tokenizer(tokenizer: TextTokenizer, directory: str | Path) -> None:
    """Write a character or byte tokenizer as ``tokenizer.json``.

    Raises:
        ConfigError: another kind of tokenizer (it has no file format here).
    """
    if isinstance(tokenizer, CharTokenizer):
        spec: dict[str, Any] = {"type": "char", "chars": tokenizer.chars}
    elif isinstance(tokenizer, ByteTokenizer):
        spec = {"type": "byte"}
    else:
        raise ConfigError(
            f"save_tokenizer: {type(tokenizer).__name__} has no file format; the GPT format "
            "saves CharTokenizer and ByteTokenizer"
        )
    (Path(directory) / TOKENIZER_FILE).write_text(json.dumps(spec))


def load_tokenizer(directory: str | Path) -> TextTokenizer:
    """The toy tokenizer saved with a GPT; UTF-8 bytes when none was saved."""
    path = Path(directory) / TOKENIZER_FILE
    if not path.is_file():
        return ByteTokenizer()
    spec = json.loads(path.read_text(encoding="utf-8"))
    if spec.get("type") == "char":
        return CharTokenizer(spec["chars"])
    if spec.get("type") == "byte":
        return ByteTokenizer()
    raise ConfigError(f"{path}: unknown tokenizer type {spec.get('type')!r}; expected char or byte")


HFKind = Literal["causal", "base"]


def load_hf_model(
    path: str | Path, kind: HFKind = "causal", dtype: torch.dtype | None = torch.float32
) -> nn.Module:
    """A Hugging Face model from a local directory (no hub): ``AutoModelForCausalLM``
    (``kind="causal"``) or ``AutoModel`` (``"base"``), in ``dtype`` (None: as saved)."""
    import transformers

    auto = transformers.AutoModelForCausalLM if kind == "causal" else transformers.AutoModel
    kwargs: dict[str, Any] = {"local_files_only": True}
    if dtype is not None:
        kwargs["dtype"] = dtype
    model: nn.Module = auto.from_pretrained(str(path), **kwargs)
    return model


def load_hf_tokenizer(path: str | Path, **kwargs: Any) -> Any:
    """A Hugging Face tokenizer from a local directory (no hub); one without a pad token
    gets its EOS as pad."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True, **kwargs)
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    return tok
