"""``deepspeed.utils.zero_to_fp32`` on slipstream checkpoints.

A slipstream checkpoint (``save_checkpoint``) holds every parameter once, split in pieces
across per-rank files, with the fp32 masters when training ran in bf16/fp16. These functions
read them back whole, from any world size and ZeRO stage, with DeepSpeed's names and
arguments. ``slipstream convert`` (``slipstream.checkpoint.convert_checkpoint``) is the
streaming exporter they reuse for safetensors output.

Differences from DeepSpeed's, on purpose: ``lazy_mode`` loads eagerly (the tensors answer
``.contiguous()`` like DeepSpeed's lazy ones); no ``zero_to_fp32.py`` copy is needed in the
checkpoint (run ``python -m slipstream.utils.zero_to_fp32`` or ``slipstream convert``).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
from pathlib import Path

import torch
from torch import nn

from slipstream.checkpoint.export import convert_checkpoint, parse_size, resolve_tag_dir
from slipstream.checkpoint.format import CheckpointReader
from slipstream.checkpoint.tp_layout import split_tp_name, tp_view

__all__ = [
    "convert_zero_checkpoint_to_fp32_state_dict",
    "get_checkpoint_files",
    "get_fp32_state_dict_from_zero_checkpoint",
    "get_model_state_files",
    "get_optim_files",
    "load_state_dict_from_zero_checkpoint",
]

_BIN_INDEX = "pytorch_model.bin.index.json"


def _tag_dir(checkpoint_dir: str | os.PathLike[str], tag: str | None) -> Path:
    return resolve_tag_dir(Path(checkpoint_dir) / tag if tag is not None else checkpoint_dir)


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
    lazy_mode: bool = False,
) -> dict[str, torch.Tensor]:
    """The model's state dict in fp32 (CPU): parameters from the fp32 masters where the
    checkpoint has them, then the persistent buffers in their own dtype.

    Args:
        checkpoint_dir: the save directory (its ``latest`` tag) or, with ``tag``, its parent.
        tag: the tag directory inside ``checkpoint_dir``; None reads ``latest``.
        exclude_frozen_parameters: leave out parameters without optimizer state (frozen).
        lazy_mode: accepted; tensors are loaded at once.
    """
    # A tensor-parallel checkpoint: each TP-sharded tensor reassembled in full.
    reader = tp_view(CheckpointReader(_tag_dir(checkpoint_dir, tag)), None)
    try:
        trained = {n.split("/", 1)[1] for n in reader.names("optim") if "/" in n}
        out: dict[str, torch.Tensor] = {}
        for name in reader.names("model"):
            if exclude_frozen_parameters and trained and name not in trained:
                continue
            source = f"master/{name}" if reader.has(f"master/{name}") else f"model/{name}"
            out[name] = reader.read_full(source).float().reshape(reader.shape(source))
        for name in reader.names("buffer"):
            out[name] = reader.read_full(f"buffer/{name}").reshape(reader.shape(f"buffer/{name}"))
        # Tied weights are stored once; their other names point at the same tensor, as in
        # DeepSpeed's state dict, so load_state_dict(strict=True) finds every key.
        shared: dict[str, str] = reader.load_object("extra.pt").get("shared_params", {})
        for alias, owner in shared.items():
            # Names of TP slices (``w.tp0of2``) stand for the full tensor read above.
            alias, owner = (n if (s := split_tp_name(n)) is None else s[0] for n in (alias, owner))
            if owner in out:
                out[alias] = out[owner]
    finally:
        reader.close()
    return out


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    max_shard_size: int | str = "5GB",
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> None:
    """Write the fp32 model to ``output_dir`` as DeepSpeed does: ``pytorch_model.bin`` (or
    ``pytorch_model-0000i-of-0000n.bin`` shards with ``pytorch_model.bin.index.json``), or
    with ``safe_serialization`` ``model.safetensors`` (shards with their index)."""
    if safe_serialization and not exclude_frozen_parameters:
        convert_checkpoint(_tag_dir(checkpoint_dir, tag), output_dir, "fp32", max_shard_size)
        return
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if safe_serialization:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
        return
    shards = _shard(state, parse_size(max_shard_size))
    if len(shards) == 1:
        torch.save(shards[0], out / "pytorch_model.bin")
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"pytorch_model-{i + 1:05d}-of-{len(shards):05d}.bin"
        torch.save(shard, out / fname)
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(v.numel() * v.element_size() for v in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / _BIN_INDEX).write_text(json.dumps(index, indent=2), encoding="utf-8")


def _shard(state: dict[str, torch.Tensor], limit: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


def load_state_dict_from_zero_checkpoint(
    model: nn.Module, checkpoint_dir: str | os.PathLike[str], tag: str | None = None
) -> nn.Module:
    """Load the checkpoint's fp32 weights into ``model`` (moved to CPU, as DeepSpeed does)
    and return it; use it after training, not on an engine's module."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


def main(argv: list[str] | None = None) -> None:
    """``python -m slipstream.utils.zero_to_fp32 CHECKPOINT_DIR OUTPUT_DIR``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("checkpoint_dir")
    p.add_argument("output_dir")
    p.add_argument("--max_shard_size", default="5GB")
    p.add_argument("--safe_serialization", action="store_true")
    p.add_argument("-t", "--tag", default=None)
    p.add_argument("--exclude_frozen_parameters", action="store_true")
    p.add_argument("-d", "--debug", action="store_true")
    a = p.parse_args(argv)
    convert_zero_checkpoint_to_fp32_state_dict(
        a.checkpoint_dir,
        a.output_dir,
        a.max_shard_size,
        a.safe_serialization,
        a.tag,
        a.exclude_frozen_parameters,
    )


if __name__ == "__main__":
    main()


def _natural_key(path: str) -> list[object]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path)]


def get_checkpoint_files(checkpoint_dir: str | os.PathLike[str], glob_pattern: str) -> list[str]:
    """The files of a DeepSpeed checkpoint tag directory matching ``glob_pattern``, in
    natural order (``rank_2`` before ``rank_10``), as DeepSpeed lists them.

    Raises:
        FileNotFoundError: nothing matches.
    """
    files = sorted(glob.glob(os.path.join(checkpoint_dir, glob_pattern)), key=_natural_key)
    if not files:
        raise FileNotFoundError(f"can't find {glob_pattern} files in directory '{checkpoint_dir}'")
    return files


def get_optim_files(checkpoint_dir: str | os.PathLike[str]) -> list[str]:
    """A DeepSpeed checkpoint's ``*_optim_states.pt`` files, in natural order."""
    return get_checkpoint_files(checkpoint_dir, "*_optim_states.pt")


def get_model_state_files(checkpoint_dir: str | os.PathLike[str]) -> list[str]:
    """A DeepSpeed checkpoint's ``*_model_states.pt`` files, in natural order."""
    return get_checkpoint_files(checkpoint_dir, "*_model_states.pt")
