"""What an engine's state is in checkpoint terms, and how to put it back at any world/stage.

Every rank writes, for each flat bucket, the part of each parameter that falls in the bucket's
``shard_slice(dp_rank)`` (at stage 0 too, so writing is spread over the ranks): its value
(``model/``), its separate fp32 master (``master/``) and its optimizer states
(``optim/<key>/``), all flattened. Loading reads, for each bucket of the *new* layout, exactly
the ranges the new rank holds: the full parameters at stages 0-2, its shard at stage 3, the
master and optimizer ranges it owns. Scalar optimizer states (Adam's ``step``) are the same for
every piece of a param group and are kept per group in the manifest.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from slipstream.checkpoint import _faults
from slipstream.checkpoint.format import (
    CheckpointError,
    LogicalReader,
    dtype_from_name,
    dtype_name,
)
from slipstream.checkpoint.tp_layout import tp_layout_entry, tp_view
from slipstream.distributed import comm
from slipstream.distributed.placement import is_duplicate, tp_shard
from slipstream.zero.gathered import GatheredParameters
from slipstream.zero.holdings import BucketShard
from slipstream.zero.optimizer import ZeroOptimizer
from slipstream.zero.param import full_shape

__all__ = ["Collected", "collect_state", "restore_state"]


@dataclass
class Collected:
    """This rank's share of a checkpoint."""

    pieces: dict[str, tuple[str, int, int, torch.Tensor]] = field(default_factory=dict)
    tensors: dict[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)
    optim_scalars: dict[int, dict[str, Any]] = field(default_factory=dict)
    tp_layout: dict[str, list[int]] = field(default_factory=dict)
    """TP-sharded parameter -> ``[split dim, fused blocks, TP size]`` (``tp_layout``)."""

    def add(self, tensor: str, start: int, data: torch.Tensor, shape: tuple[int, ...]) -> None:
        data = data.reshape(-1)
        if data.numel() == 0:
            return
        key = f"{tensor}@{start}"
        self.pieces[key] = (tensor, start, start + data.numel(), data)
        self.tensors[tensor] = (tuple(shape), dtype_name(data.dtype))


def _frozen(module: nn.Module, opt: ZeroOptimizer | None) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in module.named_parameters() if opt is None or not opt.trains(p)]


def _buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """Persistent buffers by state-dict name (what ``state_dict`` would hold)."""
    out = {}
    for mod_name, mod in module.named_modules():
        for name, t in mod._buffers.items():
            if t is not None and name not in mod._non_persistent_buffers_set:
                out[f"{mod_name}.{name}" if mod_name else name] = t
    return out


def checkpoint_name(name: str, p: torch.Tensor) -> str:
    """A parameter's name in the checkpoint: a tensor-parallel shard is stored as its own
    tensor, ``<name>.tp<rank>of<size>`` (``tp_layout`` re-cuts it at another TP size)."""
    shard = tp_shard(p)
    if shard is None:
        return name
    return f"{name}.tp{shard.rank}of{shard.size}"


def placed(name: str, p: torch.Tensor, shape: tuple[int, ...]) -> tuple[str, int, tuple[int, ...]]:
    """A parameter's checkpoint tensor, the flat offset of this rank's part in it, and the
    tensor's shape. An MoE expert parameter of ``ep_size`` > 1 is stored by global expert id
    (``slipstream.moe.plan.ExpertPlacement``): its module-per-expert name made global, or its
    stacked ``[local experts, ...]`` tensor as rows of the ``[all experts, ...]`` tensor, so that
    every expert is saved once and loads at any ``ep_size``."""
    base = checkpoint_name(name, p)
    place = getattr(p, "expert_placement", None)
    if place is None:
        return base, 0, shape
    return place.global_name(base), place.offset(math.prod(shape)), place.global_shape(shape)


def shared_parameter_names(module: nn.Module) -> dict[str, str]:
    """Tied parameters: each extra name of a parameter -> the name it is saved under (the
    first, as ``named_parameters`` keeps it). DeepSpeed records these as ``shared_params``."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        owner = first.setdefault(id(p), checkpoint_name(name, p))
        if owner != checkpoint_name(name, p):
            aliases[checkpoint_name(name, p)] = owner
    return aliases


_TP_SUFFIX = re.compile(r"\.tp(\d+)of(\d+)$")


def _tp_rank(module: nn.Module) -> int:
    for p in module.parameters():
        shard = tp_shard(p)
        if shard is not None:
            return shard.rank
    return 0


def _writes(name: str, p: torch.Tensor, tp_rank: int) -> bool:
    """Whether this rank's copy of ``p`` is the one written (each value goes in once):
    replicated tensors by tensor-parallel rank 0, TP shards by every TP rank under their own
    names, and a tied layer's non-owning copy (marked by ``PipelineModule``) by no one but
    its owner stage."""
    if is_duplicate(p):
        return False
    return tp_rank == 0 or checkpoint_name(name, p) != name


def _scalar(value: Any) -> dict[str, Any]:
    if isinstance(value, torch.Tensor):
        return {"value": value.item(), "tensor": True, "dtype": dtype_name(value.dtype)}
    return {"value": value, "tensor": False}


@torch.no_grad()
def collect_state(module: nn.Module, opt: ZeroOptimizer | None, rank: int) -> Collected:
    """Gather (as views, no copies where possible) what this rank writes."""
    out = Collected()
    frozen = _frozen(module, opt)
    # Replicated tensors are written once per pipeline stage: by data-parallel rank 0 of
    # tensor-parallel rank 0 (TP shards by every TP rank, under their own names).
    tp_rank = _tp_rank(module)
    for name, p in module.named_parameters():
        entry = tp_layout_entry(p)
        if entry is not None:  # under the name the tensor is saved by (an expert's global id)
            place = getattr(p, "expert_placement", None)
            out.tp_layout[name if place is None else place.global_name(name)] = entry
    lead = (rank if opt is None else opt.dp_rank) == 0
    # Frozen weights stored as int8 under ZeRO-3 exist in full only while gathered (every
    # rank enters; a no-op for ordinary replicated frozen weights).
    with GatheredParameters([p for _, p in frozen]):
        for name, p in frozen:
            place = getattr(p, "expert_placement", None)
            writer = place.edp_lead if place is not None else lead
            if writer and _writes(name, p, tp_rank):
                tensor, off, shape = placed(name, p, tuple(p.shape))
                out.add(f"model/{tensor}", off, p.detach().clone(), shape)
    if lead and tp_rank == 0:
        for name, t in _buffers(module).items():
            out.add(f"buffer/{name}", 0, t.detach(), tuple(t.shape))
    if opt is None:
        return out
    for shard in opt.bucket_shards():
        before = set(out.pieces)
        _collect_bucket(out, opt, shard, tp_rank)
        if shard.transient:
            # Pieces must outlive the swap-out that frees them.
            for k in set(out.pieces) - before:
                name_, s0, s1, data = out.pieces[k]
                out.pieces[k] = (name_, s0, s1, data.clone())
    return out


def _collect_bucket(out: Collected, opt: ZeroOptimizer, shard: BucketShard, tp_rank: int) -> None:
    """This rank's share of one bucket: the part of each parameter in its shard of the bucket
    (at stage 0 too, so that writing is spread over the ranks)."""
    bucket = shard.bucket
    # Expert buckets are sharded over their expert-data-parallel group.
    rank = opt.dp_rank if bucket.expert is None else comm.get_rank(bucket.expert.edp_group)
    w = bucket.shard_slice(rank)
    where = [placed(n, p, tuple(s)) for n, p, s in zip(bucket.names, bucket.params, bucket.shapes)]
    names = [t for t, _, _ in where]
    replicas = [not _writes(n, p, tp_rank) for n, p in zip(bucket.names, bucket.params)]
    for i, (name, skip) in enumerate(zip(names, replicas)):
        mine = bucket.param_slice(i, w.start, w.stop)
        if not mine or skip:
            continue
        _, off, shape = where[i]
        start = off + mine.param.start
        out.add(f"model/{name}", start, shard.params[mine.at(shard.held[0])], shape)
        if shard.separate_master:
            master = shard.master[mine.at(shard.owned[0])]
            out.add(f"master/{name}", start, master, shape)
    for piece in shard.pieces:
        state = opt.state.get(piece.view)
        if not state:
            continue
        mine = piece.extent.within(w.start, w.stop)
        for key, value in state.items():
            # Per-element states have the view's elements; a scalar (Adam's 0-d ``step``) is
            # kept per group, also beside a one-element piece.
            per_element = isinstance(value, torch.Tensor) and value.dim() > 0
            if per_element and value.numel() == piece.view.numel() > 0:
                if mine and not replicas[piece.index]:
                    part = value.reshape(-1)[mine.at(piece.extent.start)]
                    tensor = f"optim/{key}/{names[piece.index]}"
                    _, off, shape = where[piece.index]
                    out.add(tensor, off + mine.param.start, part, shape)
            else:
                out.optim_scalars.setdefault(bucket.group_index, {})[key] = _scalar(value)


def check_compatible(reader: LogicalReader, module: nn.Module, opt: ZeroOptimizer | None) -> None:
    """Same parameter names and shapes as the checkpoint, or an error listing the differences.

    A rank holding part of the model (a pipeline stage, a tensor-parallel shard) checks its
    own parameters only. ``reader`` presents TP-sharded tensors in this engine's layout
    (``tp_layout.tp_view``), so a checkpoint saved at another TP degree fits.
    """
    have = {}
    for n, p in module.named_parameters():
        tensor, _, shape = placed(n, p, tuple(full_shape(p)))
        have[tensor] = shape
    saved = {n: reader.shape(f"model/{n}") for n in reader.names("model")}
    mine = {n for n in have if _TP_SUFFIX.search(n)}
    missing = sorted(set(have) - set(saved))
    # A rank holding some of the experts (ep_size > 1) checks its own.
    experts = any(hasattr(p, "expert_placement") for p in module.parameters())
    partial = bool(mine) or int(getattr(module, "num_stages", 1)) > 1 or experts
    unexpected = [] if partial else sorted(set(saved) - set(have))
    wrong = [
        f"{n}: model {have[n]} vs checkpoint {saved[n]}"
        for n in have
        if n in saved and have[n] != saved[n]
    ]
    if missing or unexpected or wrong:
        parts = []
        if missing:
            parts.append(f"missing from the checkpoint: {missing[:8]}")
        if unexpected:
            parts.append(f"not in the model: {unexpected[:8]}")
        if wrong:
            parts.append(f"shape mismatch: {wrong[:8]}")
        raise CheckpointError(
            f"checkpoint {reader.dir} does not fit this model ({'; '.join(parts)}). Build the "
            "same model architecture as the one that was saved"
        )


def _value_source(reader: LogicalReader, name: str, dtype: torch.dtype) -> str:
    """Where a parameter's value comes from: its own dtype if saved so, else the fp32 master."""
    model = f"model/{name}"
    master = f"master/{name}"
    if reader.dtype(model) != dtype and reader.has(master):
        return master
    return model


@torch.no_grad()
def restore_state(
    reader: LogicalReader,
    module: nn.Module,
    opt: ZeroOptimizer | None,
    load_optimizer_states: bool,
) -> None:
    """Fill parameters, masters and (optionally) optimizer states from ``reader``.

    A step that fails on this rank only (a read error, a model that does not fit this
    pipeline stage) must not make it skip the collectives that follow (the other ranks would
    wait in them): after the first failure the remaining reads are skipped, the collectives
    still run, and the error is raised at the end.
    """
    failed: list[Exception] = []
    # Saved at another TP degree (or without TP): reassembled and re-cut per parameter.
    reader = tp_view(reader, module)

    def attempt(step: Callable[[], None]) -> None:
        if failed:
            return
        try:
            step()
        except Exception as e:
            failed.append(e)

    attempt(lambda: check_compatible(reader, module, opt))
    frozen = _frozen(module, opt)
    with GatheredParameters([p for _, p in frozen], modifier_rank=0):
        attempt(lambda: _read_frozen(reader, frozen))
    attempt(lambda: _read_buffers(reader, module))
    if opt is not None:
        attempt(lambda: _restore_buckets(reader, opt, load_optimizer_states))
        attempt(lambda: _faults.point("load.restored"))
        opt.reload_params()  # collective: runs even after a failure on this rank
    if failed:
        raise failed[0]


def _read_frozen(reader: LogicalReader, frozen: list[tuple[str, nn.Parameter]]) -> None:
    for name, p in frozen:
        tensor, off, _ = placed(name, p, tuple(p.shape))
        src = _value_source(reader, tensor, p.dtype)
        reader.read(src, off, off + p.numel(), out=p.data.view(-1))


def _read_buffers(reader: LogicalReader, module: nn.Module) -> None:
    buffers = _buffers(module)
    for name in reader.names("buffer"):
        if name in buffers:
            buffers[name].copy_(reader.read_full(f"buffer/{name}"))


def _restore_buckets(
    reader: LogicalReader, opt: ZeroOptimizer, load_optimizer_states: bool
) -> None:
    """Parameters, masters and optimizer states of every bucket: reads only, no collectives.
    Each rank reads the parameter values it stores (all of them at stages 0-2, its shard at
    stage 3) and the masters of the region it updates."""
    scalars: dict[str, dict[str, Any]] = reader.manifest.get("optim_scalars", {})
    keys: list[str] = reader.manifest.get("optim_keys", [])
    for shard in opt.bucket_shards():
        _read_bucket(reader, shard)
        if load_optimizer_states:
            _restore_optimizer_states(reader, opt, shard, keys, scalars)


def _read_bucket(reader: LogicalReader, shard: BucketShard) -> None:
    bucket, params = shard.bucket, shard.params
    for i, (p, name) in enumerate(zip(bucket.params, bucket.names)):
        name, off, _ = placed(name, p, tuple(bucket.shapes[i]))
        held = bucket.param_slice(i, *shard.held)
        if held:
            src = _value_source(reader, name, params.dtype)
            out = params[held.at(shard.held[0])]
            reader.read(src, off + held.param.start, off + held.param.stop, out=out)
        owned = bucket.param_slice(i, *shard.owned)
        if shard.separate_master and owned:
            msrc = f"master/{name}" if reader.has(f"master/{name}") else f"model/{name}"
            out = shard.master[owned.at(shard.owned[0])]
            reader.read(msrc, off + owned.param.start, off + owned.param.stop, out=out)


def _restore_optimizer_states(
    reader: LogicalReader,
    opt: ZeroOptimizer,
    shard: BucketShard,
    keys: list[str],
    scalars: dict[str, dict[str, Any]],
) -> None:
    bucket = shard.bucket
    group_scalars = scalars.get(str(bucket.group_index), {})
    # torch's placement of scalar states (``step``): on the parameter's device for fused and
    # capturable kernels, which refuse a CPU step tensor, else on the CPU.
    group = opt.param_groups[bucket.group_index]
    on_device = bool(group.get("fused") or group.get("capturable"))
    for piece in shard.pieces:
        i = piece.index
        name, off, _ = placed(bucket.names[i], bucket.params[i], tuple(bucket.shapes[i]))
        state: dict[str, Any] = {}
        for key in keys:
            tensor = f"optim/{key}/{name}"
            if not reader.has(tensor):
                raise CheckpointError(
                    f"checkpoint {reader.dir} has optimizer state '{key}' but not for parameter "
                    f"'{name}'"
                )
            span = piece.extent.param
            value = reader.read(tensor, off + span.start, off + span.stop)
            state[key] = value.to(piece.view.device)
        for key, entry in group_scalars.items():
            value = entry["value"]
            if entry["tensor"]:
                device = piece.view.device if on_device else torch.device("cpu")
                value = torch.tensor(value, dtype=dtype_from_name(entry["dtype"]), device=device)
            state[key] = value
        if state:
            opt.state[piece.view] = state
        else:
            opt.state.pop(piece.view, None)
