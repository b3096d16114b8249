"""Consolidated 16-bit model export and gather-once access for ZeRO-partitioned models.

``save_16bit_model`` writes Hugging Face-style sharded safetensors (plus an index file),
gathering one ZeRO-3 unit at a time, so no rank ever holds more than one unit beyond its own
shard and the files are written as they fill.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from slipstream.distributed import comm
from slipstream.zero.gathered import GatheredParameters
from slipstream.zero.sharded_store import unit_owner

__all__ = ["gathered_model", "save_16bit_model"]

INDEX_FILE = "model.safetensors.index.json"


@contextmanager
def gathered_model(module: nn.Module) -> Iterator[nn.Module]:
    """Gather every partitioned parameter once for the whole block (e.g. generation).

    Autoregressive decoding under ZeRO-3 would otherwise gather each unit for every token.
    Every rank must enter it. Costs one full copy of the model per rank while open.
    """
    with GatheredParameters(list(module.parameters())):
        yield module


def _tensor_groups(module: nn.Module) -> list[list[tuple[str, torch.Tensor]]]:
    """Named tensors of the state dict, grouped so each group is gathered together."""
    groups: dict[object, list[tuple[str, torch.Tensor]]] = {}
    seen: set[int] = set()
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        owner = unit_owner(p)
        key = (id(owner.store), owner.unit.index) if owner is not None else "replicated"
        groups.setdefault(key, []).append((name, p))
    for name, b in module.named_buffers():
        groups.setdefault("replicated", []).append((name, b))
    return list(groups.values())


def save_16bit_model(
    module: nn.Module,
    save_dir: str | os.PathLike[str],
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = 2 * 2**30,
) -> Path:
    """Write ``module``'s full weights as sharded safetensors in ``dtype`` (rank 0 writes).

    Every rank must call it (ZeRO-3 units are gathered collectively; tensor-parallel shards
    are all-gathered into full tensors). Peak extra memory is one unit plus one output shard.
    Returns the index file path.
    """
    from safetensors.torch import save_file

    stages = int(getattr(module, "num_stages", 1))
    if stages > 1:  # rank 0 holds one stage: it would write a partial model
        raise ValueError(
            f"save_16bit_model of a PipelineModule with {stages} stages is not supported: "
            "each stage holds only its layers; use engine.save_checkpoint (it loads at any "
            "pipeline layout, one stage included) and export from a 1-stage load"
        )
    out = Path(save_dir)
    rank0 = comm.get_rank() == 0
    if rank0:
        out.mkdir(parents=True, exist_ok=True)
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = 0
    files: list[str] = []
    weight_map: dict[str, str] = {}

    def flush() -> None:
        nonlocal shard, shard_bytes
        if not shard:
            return
        name = f"model-{len(files) + 1:05d}.safetensors"
        tmp = out / (name + ".tmp")
        save_file(shard, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, out / name)
        files.append(name)
        weight_map.update(dict.fromkeys(shard, name))
        shard, shard_bytes = {}, 0

    tp_group = getattr(module, "tp_group", None)  # set by parallelize_tp_
    for group in _tensor_groups(module):
        with GatheredParameters([t for _, t in group if isinstance(t, nn.Parameter)]):
            if tp_group is not None:  # full tensors from the TP shards (collective)
                from slipstream.parallel.tensor import unshard_tp

                group = [(name, unshard_tp(t, tp_group)) for name, t in group]
            if not rank0:
                continue
            for name, t in group:
                value = t.detach().to("cpu", dtype if t.is_floating_point() else t.dtype).clone()
                if (
                    shard_bytes
                    and shard_bytes + value.numel() * value.element_size() > max_shard_bytes
                ):
                    flush()
                shard[name] = value.contiguous()
                shard_bytes += value.numel() * value.element_size()
    index = out / INDEX_FILE
    if rank0:
        flush()
        total = sum((out / f).stat().st_size for f in files)
        index.write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )
    if comm.is_initialized():
        comm.barrier()
    return index
