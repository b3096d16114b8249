"""Models and tokenizers of ``slipstream chat`` on disk: load, build, save.

A model is a local Hugging Face directory (loaded offline), a saved slipstream GPT (the format
of :mod:`slipstream.models.files`: ``gpt_config.json`` + ``model.safetensors`` +
``tokenizer.json``, which ``slipstream quant eval`` and ``slipstream generate`` read too) or
``gpt:PRESET``, a fresh reference GPT with a character tokenizer built from the data. A reward
model (step 2's output) is its base model's directory plus ``v_head.pt``. Saving gathers
ZeRO-3 parameters, merges LoRA adapters into the weights (a plain model on disk) and writes
on rank 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from slipstream.config import ConfigError
from slipstream.data.tokenizer import CharTokenizer
from slipstream.distributed import comm
from slipstream.models import files
from slipstream.models.gpt import GPT, GPTConfig
from slipstream.rlhf.lora import merge_lora_state_dict
from slipstream.rlhf.reward import RewardModel
from slipstream.zero import gathered_model

__all__ = [
    "GPT_FILE",
    "V_HEAD_FILE",
    "CharTokenizer",
    "is_trained_reward_model",
    "load_lm",
    "load_reward_model",
    "load_tokenizer",
    "model_kind",
    "require_trained_reward_model",
    "save_model",
]

GPT_FILE = files.GPT_CONFIG_FILE
V_HEAD_FILE = "v_head.pt"


def model_kind(spec: str, what: str) -> str:
    """``"preset"`` (``gpt:NAME``), ``"gpt"`` (a saved reference GPT) or ``"hf"``."""
    if spec.startswith("gpt:"):
        return "preset"
    path = Path(spec)
    if files.is_gpt_dir(path):
        return "gpt"
    if (path / "config.json").is_file():
        return "hf"
    raise ConfigError(
        f"--{what} {spec!r} is neither a Hugging Face model directory (no config.json), a "
        f"saved slipstream GPT (no {GPT_FILE}) nor gpt:PRESET (gpt:tiny, gpt:small, gpt:25m)"
    )


def load_tokenizer(spec: str, what: str, texts: Sequence[str]) -> Any:
    """The tokenizer of model ``spec`` (cheap: no weights), so that the actor's and the
    reward model's can be compared before any training. A Hugging Face tokenizer without a
    pad token gets its EOS as pad (as DeepSpeed-Chat does)."""
    kind = model_kind(spec, what)
    if kind == "preset":
        return CharTokenizer.from_texts(texts)
    if kind == "gpt":
        return files.load_tokenizer(spec)
    return files.load_hf_tokenizer(spec)


def _gpt_from_preset(spec: str, tok: CharTokenizer, max_len: int, seed: int) -> GPT:
    torch.manual_seed(seed)
    cfg = GPTConfig.preset(
        spec.removeprefix("gpt:"), vocab_size=tok.vocab_size, max_seq_len=max_len
    )
    return GPT(cfg)


def load_lm(spec: str, tok: Any, max_len: int, seed: int) -> nn.Module:
    """The causal LM ``spec`` names (``--actor``): new (``gpt:PRESET``) or loaded."""
    kind = model_kind(spec, "actor")
    if kind == "preset":
        return _gpt_from_preset(spec, tok, max_len, seed)
    if kind == "gpt":
        if is_trained_reward_model(spec):
            raise ConfigError(f"--actor {spec} is a reward model (step 2's output), not an LM")
        return files.load_gpt(spec)
    return files.load_hf_model(spec, dtype=None)


def is_trained_reward_model(spec: str) -> bool:
    """Whether ``spec`` is a directory step 2 wrote (it holds the value head)."""
    path = Path(spec)
    meta = files.legacy_meta(path)
    if meta is not None:
        return bool(meta.get("reward"))
    return (path / V_HEAD_FILE).is_file()


def require_trained_reward_model(spec: str) -> None:
    if not is_trained_reward_model(spec):
        raise ConfigError(
            f"step 3 needs a trained reward model (step 2's output directory); --reward {spec} "
            "is not one (an LM or gpt:PRESET): run --step 2 first, or --step all"
        )


def load_reward_model(spec: str, tok: Any, max_len: int, seed: int) -> RewardModel:
    """``--reward``: a trained reward model (step 2's output: the value head is loaded) or
    an LM to start step 2 from (a new value head; its LM head is dropped)."""
    kind = model_kind(spec, "reward")
    path = Path(spec)
    if kind == "preset":
        return RewardModel(_gpt_from_preset(spec, tok, max_len, seed + 1))
    trained = is_trained_reward_model(spec)
    if kind == "gpt":
        rm = RewardModel(GPT(files.load_gpt_config(path)))
        state = files.load_gpt_state(path)
        if files.legacy_meta(path) is not None and trained:  # the whole RewardModel's state
            rm.load_state_dict(state)
            return rm
        # The backbone (an LM's LM head is dropped); a trained model's value head beside it.
        rm.backbone.load_state_dict({k: v for k, v in state.items() if k != "lm_head.weight"})
    else:
        rm = RewardModel(files.load_hf_model(spec, "base" if trained else "causal", None))
    if trained:
        rm.v_head.load_state_dict(torch.load(path / V_HEAD_FILE, weights_only=True))
    return rm


def _full_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s state dict as whole tensors on every rank (ZeRO-3 gathered for it)."""
    with gathered_model(module):
        return {k: v.detach().clone().cpu() for k, v in module.state_dict().items()}


def save_model(module: nn.Module, tok: Any, directory: Path) -> None:
    """Write a causal LM or a :class:`RewardModel` (every rank calls; rank 0 writes): the
    GPT format of :mod:`slipstream.models.files` or Hugging Face ``save_pretrained``, plus
    ``v_head.pt`` for a reward model."""
    state = merge_lora_state_dict(module, _full_state(module))  # a plain model on disk
    if comm.get_rank() != 0:
        return
    directory.mkdir(parents=True, exist_ok=True)
    reward = isinstance(module, RewardModel)
    inner = module.backbone if isinstance(module, RewardModel) else module
    if reward:
        torch.save({"weight": state["v_head.weight"]}, directory / V_HEAD_FILE)
        state = {k.removeprefix("backbone."): v for k, v in state.items() if k != "v_head.weight"}
    if isinstance(inner, GPT):
        files.save_gpt(inner.config, state, directory, tok)
        return
    inner.save_pretrained(directory, state_dict=state)  # type: ignore[operator]
    tok.save_pretrained(directory)
