"""``init_inference(checkpoint=...)``: load weights into the model before it is converted.

Accepted: a slipstream checkpoint (a save directory or a tag directory, read through its
verified manifest), an exported or Hugging Face safetensors directory (one file or shards
with an index), a single ``.safetensors`` / ``.pt`` / ``.bin`` file, or DeepSpeed's JSON
description ``{"checkpoints": [files...]}`` (a dict or the path of a ``.json`` file).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from slipstream.config._errors import ConfigError

__all__ = ["load_weights"]


def _read_file(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    if path.suffix in (".pt", ".pth", ".bin"):
        state = torch.load(path, map_location="cpu", weights_only=True)
        return state.get("module", state) if isinstance(state, dict) else state
    raise ConfigError(
        f"init_inference: checkpoint file {path} is not .safetensors, .pt, .pth or .bin"
    )


def _read_slipstream(path: Path) -> dict[str, torch.Tensor]:
    """Model tensors of a slipstream checkpoint (fp32 master copies where they exist)."""
    from slipstream.checkpoint.export import resolve_tag_dir
    from slipstream.checkpoint.format import CheckpointReader
    from slipstream.checkpoint.tp_layout import tp_view

    reader = tp_view(CheckpointReader(resolve_tag_dir(path)), None)  # TP slices joined
    try:
        state = {}
        for name in reader.names("model"):
            master = f"master/{name}"
            state[name] = reader.read_full(master if reader.has(master) else f"model/{name}")
        for name in reader.names("buffer"):
            state[name] = reader.read_full(f"buffer/{name}")
        return state
    finally:
        reader.close()


def _read_dir(path: Path) -> dict[str, torch.Tensor]:
    if (path / "manifest.json").is_file() or (path / "latest").is_file():
        return _read_slipstream(path)
    files = sorted(path.glob("*.safetensors")) or sorted(path.glob("*.bin"))
    if not files:
        raise ConfigError(
            f"init_inference: checkpoint directory {path} holds no slipstream checkpoint "
            "(manifest.json / latest) and no .safetensors or .bin files"
        )
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(_read_file(f))
    return state


def _resolve(spec: str | dict[str, Any], base_dir: str) -> dict[str, torch.Tensor]:
    if isinstance(spec, str) and spec.endswith(".json") and Path(base_dir, spec).is_file():
        spec = json.loads(Path(base_dir, spec).read_text(encoding="utf-8"))
    if isinstance(spec, dict):
        files = spec.get("checkpoints")
        if isinstance(files, str):
            files = [files]
        if not isinstance(files, list) or not files:
            raise ConfigError(
                f"init_inference: checkpoint description {spec!r} has no 'checkpoints' list; "
                'write {"checkpoints": ["model.safetensors", ...]}'
            )
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(_resolve(str(f), spec.get("base_dir", base_dir)))
        return state
    path = Path(base_dir, spec)
    if path.is_dir():
        return _read_dir(path)
    if path.is_file():
        return _read_file(path)
    raise ConfigError(f"init_inference: checkpoint {str(path)!r} does not exist")


def _tied(model: nn.Module) -> set[str]:
    """Parameter names that share their tensor with an earlier name (tied embeddings): a
    checkpoint stores only one of them."""
    first: dict[int, str] = {}
    tied = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            tied.add(name)
        first.setdefault(id(p), name)
    return tied


def load_weights(model: nn.Module, spec: str | dict[str, Any], base_dir: str = "") -> None:
    """Load the checkpoint ``spec`` into ``model`` in place (weights keep the model's dtype).

    Raises:
        ConfigError: the checkpoint is missing, or its tensor names do not match the model
            (names listed), or a shape differs.
    """
    state = _resolve(spec, base_dir)
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if k not in _tied(model)]
    if missing or result.unexpected_keys:
        raise ConfigError(
            f"init_inference: checkpoint {spec!r} does not match {type(model).__name__}: "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, unexpected "
            f"{result.unexpected_keys[:5]}; load it into the model it was saved from"
        )
