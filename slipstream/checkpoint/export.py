"""Export a checkpoint as a consolidated Hugging Face-style model, streaming.

``convert_checkpoint`` reads each parameter (and persistent buffer) from the checkpoint's
pieces, casts it and appends it to the current output shard, one tensor at a time: peak memory
is about the largest tensor, whatever the model size. Shards are ``model-0000i-of-0000n.
safetensors`` with a ``model.safetensors.index.json`` (a single ``model.safetensors`` when it
fits one shard); if the checkpoint came from a Hugging Face model its ``config.json`` is
written too, so ``from_pretrained(out_dir)`` loads the result.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch

from slipstream.checkpoint.commit import find_checkpoint
from slipstream.checkpoint.format import (
    CheckpointError,
    CheckpointReader,
    StreamingSafetensorsWriter,
    atomic_write_text,
)
from slipstream.checkpoint.tp_layout import tp_view
from slipstream.zero.export import INDEX_FILE

__all__ = ["HF_CONFIG", "convert_checkpoint", "parse_size"]

HF_CONFIG = "hf_config.json"
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_size(size: int | str) -> int:
    """``"5GB"``, ``"500MB"``, ``"2GiB"`` or a byte count."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", size, re.IGNORECASE)
    if m is None:
        raise ValueError(f"max shard size {size!r} is not a size like '5GB', '500MB' or 1000000")
    base = 1024 if m.group(3) else 1000
    power = " KMGT".index(m.group(2).upper() or " ")
    return int(float(m.group(1)) * base**power)


def resolve_tag_dir(path: str | os.PathLike[str]) -> Path:
    """A tag directory, or a save directory whose ``latest`` names one (read only: a tag a
    crashed save left missing is read from its ``.old`` copy in place)."""
    p = Path(path)
    if (p / "manifest.json").is_file():
        return p
    found = find_checkpoint(p, None, recover=False) if p.is_dir() else None
    if found is None:
        raise CheckpointError(
            f"{p} is neither a checkpoint tag directory (no manifest.json) nor a save directory "
            "with a 'latest' file: pass the directory save_checkpoint wrote"
        )
    return found


def convert_checkpoint(
    checkpoint: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
) -> Path:
    """Write the checkpoint's model as consolidated safetensors shards in ``out_dir``.

    Args:
        checkpoint: a tag directory or a save directory (its ``latest`` tag is used).
        out_dir: output directory (created; existing model files in it are replaced).
        dtype: ``"fp32"``, ``"bf16"``, ``"fp16"`` or a torch dtype; default: the training
            dtype of each parameter. fp32 output uses the fp32 master weights when the model
            trained in bf16/fp16.
        max_shard_size: largest shard (e.g. ``"5GB"``); a bigger tensor gets its own shard.
    Returns:
        The index file (or the single ``model.safetensors``).
    """
    # A tensor-parallel checkpoint: each TP-sharded tensor reassembled in full.
    reader = tp_view(CheckpointReader(resolve_tag_dir(checkpoint)), None)
    want = _DTYPES[dtype] if isinstance(dtype, str) else dtype
    if isinstance(dtype, str) and dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(_DTYPES)}")
    limit = parse_size(max_shard_size)
    entries: list[
        tuple[str, str, torch.dtype, tuple[int, ...]]
    ] = []  # (name, source, out dtype, shape)
    for name in reader.names("model"):
        source = f"model/{name}"
        out_dtype = want or reader.dtype(source)
        if out_dtype == torch.float32 and reader.has(f"master/{name}"):
            source = f"master/{name}"
        entries.append((name, source, out_dtype, reader.shape(source)))
    for name in reader.names("buffer"):
        source = f"buffer/{name}"
        src_dtype = reader.dtype(source)
        out_dtype = want if want is not None and src_dtype.is_floating_point else src_dtype
        entries.append((name, source, out_dtype, reader.shape(source)))

    shards: list[list[tuple[str, str, torch.dtype, tuple[int, ...]]]] = [[]]
    size = 0
    for entry in entries:
        nbytes = reader.numel(entry[1]) * torch.empty((), dtype=entry[2]).element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("model*.safetensors"), out / INDEX_FILE]:
        old.unlink(missing_ok=True)
    n = len(shards)
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards):
        fname = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        writer = StreamingSafetensorsWriter(out / fname, [(e[0], e[3], e[2]) for e in shard])
        for name, source, out_dtype, shape in shard:
            value = reader.read(source).to(out_dtype).reshape(shape)
            writer.write(name, value)
            total += value.numel() * value.element_size()
            weight_map[name] = fname
            del value
        writer.finish()
    reader.close()
    hf_config = reader.dir / HF_CONFIG
    if hf_config.is_file():
        shutil.copyfile(hf_config, out / "config.json")
    if n == 1:
        return out / "model.safetensors"
    index = out / INDEX_FILE
    atomic_write_text(
        index,
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2),
    )
    return index
