"""Models and tokenizers of ``slipstream chat`` on disk: load, build, save.

A model is a local Hugging Face directory (``AutoModelForCausalLM`` / ``AutoTokenizer``,
offline), a saved slipstream GPT (``slipstream_gpt.json`` + ``model.pt`` +
``tokenizer.json``) or ``gpt:PRESET``, a fresh reference GPT with a character tokenizer built
from the data. A reward model (step 2's output) also holds ``v_head.pt``. Saving gathers
ZeRO-3 parameters, merges LoRA adapters into the weights (a plain model on disk) and writes
on rank 0.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from slipstream.config import ConfigError
from slipstream.distributed import comm
from slipstream.models.gpt import GPT, GPTConfig
from slipstream.rlhf.chat import RewardModel
from slipstream.rlhf.lora import merge_lora_state_dict
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

GPT_FILE = "slipstream_gpt.json"
V_HEAD_FILE = "v_head.pt"


# ---------------------------------------------------------------------------- tokenizers


class CharTokenizer:
    """One id per character, for the reference GPT: pad 0, EOS 1, the characters from 2.

    Built from the data (:meth:`from_texts`), saved with the model (``tokenizer.json``).
    """

    pad_token_id: int | None = 0
    eos_token_id: int | None = 1
    chat_template = None

    def __init__(self, chars: str) -> None:
        self.chars = chars
        self._ids = {c: i + 2 for i, c in enumerate(chars)}

    @classmethod
    def from_texts(cls, texts: Sequence[str]) -> CharTokenizer:
        return cls("".join(sorted(set("".join(texts)))))

    @property
    def vocab_size(self) -> int:
        return len(self.chars) + 2

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        try:
            return [self._ids[c] for c in text]
        except KeyError as e:
            raise ConfigError(
                f"character {e.args[0]!r} of {text[:40]!r} is not in this character "
                f"tokenizer's vocabulary ({self.chars!r}): the model was built from other data"
            ) from None

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.chars[i - 2] for i in ids if i >= 2)

    def save(self, directory: Path) -> None:
        (directory / "tokenizer.json").write_text(json.dumps({"type": "char", "chars": self.chars}))

    @classmethod
    def load(cls, directory: Path) -> CharTokenizer:
        spec = json.loads((directory / "tokenizer.json").read_text())
        return cls(spec["chars"])


# ---------------------------------------------------------------------------- models


def model_kind(spec: str, what: str) -> str:
    """``"preset"`` (``gpt:NAME``), ``"gpt"`` (a saved reference GPT) or ``"hf"``."""
    if spec.startswith("gpt:"):
        return "preset"
    path = Path(spec)
    if (path / GPT_FILE).is_file():
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
        return CharTokenizer.load(Path(spec))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(spec, local_files_only=True)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def _gpt_from_preset(spec: str, tok: CharTokenizer, max_len: int, seed: int) -> GPT:
    torch.manual_seed(seed)
    cfg = GPTConfig.preset(
        spec.removeprefix("gpt:"), vocab_size=tok.vocab_size, max_seq_len=max_len
    )
    return GPT(cfg)


def _load_gpt(path: Path) -> tuple[GPT, dict[str, Any]]:
    meta = json.loads((path / GPT_FILE).read_text())
    return GPT(GPTConfig(**meta["config"])), meta


def load_lm(spec: str, tok: Any, max_len: int, seed: int) -> nn.Module:
    """The causal LM ``spec`` names (``--actor``): new (``gpt:PRESET``) or loaded."""
    kind = model_kind(spec, "actor")
    if kind == "preset":
        return _gpt_from_preset(spec, tok, max_len, seed)
    if kind == "gpt":
        model, meta = _load_gpt(Path(spec))
        if meta.get("reward"):
            raise ConfigError(f"--actor {spec} is a reward model (step 2's output), not an LM")
        model.load_state_dict(torch.load(Path(spec) / "model.pt", weights_only=True))
        return model
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(spec, local_files_only=True)


def is_trained_reward_model(spec: str) -> bool:
    """Whether ``spec`` is a directory step 2 wrote (it holds the value head)."""
    path = Path(spec)
    if (path / GPT_FILE).is_file():
        return bool(json.loads((path / GPT_FILE).read_text()).get("reward"))
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
    if kind == "gpt":
        gpt, meta = _load_gpt(path)
        rm = RewardModel(gpt)
        state = torch.load(path / "model.pt", weights_only=True)
        if meta.get("reward"):
            rm.load_state_dict(state)
        else:  # an LM: its LM head is dropped, the value head is new
            rm.backbone.load_state_dict({k: v for k, v in state.items() if k != "lm_head.weight"})
        return rm
    from transformers import AutoModel

    if is_trained_reward_model(spec):
        rm = RewardModel(AutoModel.from_pretrained(spec, local_files_only=True))
        rm.v_head.load_state_dict(torch.load(path / V_HEAD_FILE, weights_only=True))
        return rm
    from transformers import AutoModelForCausalLM

    return RewardModel(AutoModelForCausalLM.from_pretrained(spec, local_files_only=True))


def _full_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s state dict as whole tensors on every rank (ZeRO-3 gathered for it)."""
    with gathered_model(module):
        return {k: v.detach().clone().cpu() for k, v in module.state_dict().items()}


def save_model(module: nn.Module, tok: Any, directory: Path) -> None:
    """Write a causal LM or a :class:`RewardModel` (every rank calls; rank 0 writes): Hugging
    Face ``save_pretrained`` (plus ``v_head.pt`` for a reward model) or the GPT layout."""
    state = merge_lora_state_dict(module, _full_state(module))  # a plain model on disk
    if comm.get_rank() != 0:
        return
    directory.mkdir(parents=True, exist_ok=True)
    reward = isinstance(module, RewardModel)
    inner = module.backbone if isinstance(module, RewardModel) else module
    if isinstance(inner, GPT):
        meta = {"config": asdict(inner.config), "reward": reward}
        (directory / GPT_FILE).write_text(json.dumps(meta, indent=1))
        torch.save(state, directory / "model.pt")
        tok.save(directory)
        return
    if reward:
        backbone = {
            k.removeprefix("backbone."): v for k, v in state.items() if k != "v_head.weight"
        }
        inner.save_pretrained(directory, state_dict=backbone)  # type: ignore[operator]
        torch.save({"weight": state["v_head.weight"]}, directory / V_HEAD_FILE)
    else:
        module.save_pretrained(directory, state_dict=state)  # type: ignore[operator]
    tok.save_pretrained(directory)
