"""``slipstream convert --to slipstream``: a DeepSpeed checkpoint as a slipstream checkpoint.

Offline and streamed: ``DeepSpeedReader`` reads each logical tensor (``model/``, ``master/``,
``optim/<key>/``, ``buffer/``) from DeepSpeed's partitions and it is appended to one
safetensors file, so peak memory is about the largest tensor. The result is an ordinary
slipstream checkpoint (manifest with CRCs, ``latest``) that loads at any world size and stage.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from slipstream.checkpoint.deepspeed_pipe import open_deepspeed
from slipstream.checkpoint.format import (
    FORMAT_VERSION,
    MANIFEST,
    CheckpointError,
    StreamingSafetensorsWriter,
    atomic_write_text,
    dtype_name,
    file_digest,
    write_manifest,
    write_object,
)
from slipstream.checkpoint.from_deepspeed import is_deepspeed_tag
from slipstream.version import __version__

__all__ = ["deepspeed_to_slipstream", "resolve_deepspeed_tag"]


def resolve_deepspeed_tag(path: str | os.PathLike[str], tag: str | None = None) -> Path:
    """A DeepSpeed tag directory, or a save directory whose ``latest`` (or ``tag``) names one."""
    p = Path(path)
    if tag is None and is_deepspeed_tag(p):
        return p
    if tag is None:
        latest = p / "latest"
        if not latest.is_file():
            raise CheckpointError(
                f"{p} is neither a DeepSpeed tag directory (*_model_states.pt files) nor a save "
                "directory with a 'latest' file: pass the directory DeepSpeed's "
                "save_checkpoint wrote"
            )
        tag = latest.read_text().strip()
    directory = p / tag
    if not is_deepspeed_tag(directory):
        raise CheckpointError(f"{directory} is not a DeepSpeed checkpoint tag directory")
    return directory


def deepspeed_to_slipstream(
    source: str | os.PathLike[str], out_dir: str | os.PathLike[str], tag: str | None = None
) -> Path:
    """Write a DeepSpeed checkpoint as a slipstream checkpoint ``out_dir/<tag>`` (and
    ``out_dir/latest``), offline, one tensor at a time (peak memory about the largest).

    The result loads at any world size and stage like any slipstream checkpoint; it keeps the
    client state's own keys (not DeepSpeed's bookkeeping: ``ds_config``, ``param_shapes``...).
    """
    directory = resolve_deepspeed_tag(source, tag)
    reader = open_deepspeed(directory)
    out = Path(out_dir)
    name = directory.name
    tmp = out / f".{name}.convert-tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    shard = "rank-00000.safetensors"
    tensors = list(reader.tensors)
    layout: list[tuple[str, tuple[int, ...], torch.dtype]] = [
        (t, (reader.numel(t),), reader.dtype(t)) for t in tensors
    ]
    writer = StreamingSafetensorsWriter(tmp / shard, layout)
    for t in tensors:
        writer.write(t, reader.read(t))
    writer.finish()
    extra = reader.load_object("extra.pt")
    own = {k: v for k, v in extra["client_state"].items() if k not in _DS_BOOKKEEPING}
    files = {shard: list(file_digest(tmp / shard))}
    files["extra.pt"] = list(
        write_object(tmp / "extra.pt", {"client_state": own, "lr_scheduler": extra["lr_scheduler"]})
    )
    meta = {k: v for k, v in reader.manifest.items() if k not in ("source", "ds_version")}
    ds_version = reader.manifest.get("ds_version")
    manifest = dict(
        meta,
        format_version=FORMAT_VERSION,
        slipstream_version=__version__,
        converted_from=f"DeepSpeed {ds_version}: {directory}",
        tensors={
            t: {"shape": list(reader.shape(t)), "dtype": dtype_name(reader.dtype(t))}
            for t in tensors
        },
        pieces=[[t, 0, reader.numel(t), shard, t] for t in tensors if reader.numel(t)],
        files=files,
    )
    write_manifest(tmp / MANIFEST, manifest)
    reader.close()
    target = out / name
    if target.exists():
        raise CheckpointError(f"{target} exists: choose another output directory")
    os.replace(tmp, target)
    atomic_write_text(out / "latest", name)
    return target


# DeepSpeed's own entries of its model-states dict (returned in DeepSpeed's client state).
_DS_BOOKKEEPING = {
    "buffer_names",
    "param_shapes",
    "frozen_param_shapes",
    "shared_params",
    "frozen_param_fragments",
    "global_samples",
    "ds_config",
    "ds_version",
    "checkpoint_parallel_dimensions",
    "sparse_tensor_module_names",
    "universal_checkpoint_info",
}
