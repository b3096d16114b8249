"""Write a slipstream checkpoint in DeepSpeed's ZeRO-1/2 or ZeRO-3 layout, so a user can go back.

``export_deepspeed`` lays out, for the DeepSpeed world size asked for, exactly what DeepSpeed
0.19's ZeRO optimizers write at that size (``from_deepspeed`` describes the layouts)::

    <out>/latest
    stages 1 and 2:
    <out>/<tag>/mp_rank_00_model_states.pt                  module, param_shapes, counters,
                                                            lr scheduler, client state
    <out>/<tag>/zero_pp_rank_<r>_mp_rank_00_optim_states.pt rank r's fp32 partition and
                                                            its Adam states (torch's format)
    stage 3:
    <out>/<tag>/zero_pp_rank_<r>_mp_rank_00_model_states.pt the same per rank, the module's
                                                            parameters as empty placeholders,
                                                            frozen ones as rank r's fragments
    <out>/<tag>/zero_pp_rank_<r>_mp_rank_00_optim_states.pt rank r's piece of every parameter
                                                            (fp32, per sub-group) and its
                                                            states, DeepSpeed's loss scaler

DeepSpeed's ``load_checkpoint`` at that world size and ZeRO stage continues from it, and its
``zero_to_fp32.py`` reads it. The export needs the parameter order of each param group
(``param_order`` in the manifest, written since this module exists): DeepSpeed's flat
partitions have no names in them. At stage 3 DeepSpeed cuts each param group into sub-groups
of ``sub_group_size`` elements per rank; the export cuts them the same way for the
``sub_group_size`` given (DeepSpeed's default, 1e9, unless the DeepSpeed config sets another).
Not written: fp16 dynamic loss scaler state, MoE expert parallelism, and tensor- or
pipeline-parallel checkpoints.
"""

from __future__ import annotations

import math
import os
import shutil
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from slipstream.checkpoint.deepspeed_files import DeepSpeedObject, save_file
from slipstream.checkpoint.export import resolve_tag_dir
from slipstream.checkpoint.format import (
    CheckpointError,
    CheckpointReader,
    LogicalReader,
    atomic_write_text,
)
from slipstream.checkpoint.tp_layout import tp_view

__all__ = ["export_deepspeed"]

DS_VERSION = "0.19.8"
"""The DeepSpeed version the files say they come from (DeepSpeed refuses an empty one)."""
SUB_GROUP_SIZE = 1_000_000_000
"""DeepSpeed's default ``zero_optimization.sub_group_size``."""


def export_deepspeed(
    checkpoint: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    world_size: int | None = None,
    zero_stage: int = 2,
    tag: str | None = None,
    sub_group_size: int = SUB_GROUP_SIZE,
) -> Path:
    """Write ``checkpoint`` as a DeepSpeed ZeRO-``zero_stage`` checkpoint for ``world_size``
    data-parallel ranks (default: the world it was saved at) in ``out_dir/<tag>``.
    ``sub_group_size``: DeepSpeed's ``zero_optimization.sub_group_size`` of the run that will
    load it (stage 3 only).

    Raises:
        CheckpointError: a checkpoint without ``param_order`` (saved by an older slipstream),
            with MoE expert parallelism, fp16 with a dynamic loss
            scale at stage 3, or a stage other than 1, 2 or 3.
    """
    if zero_stage not in (1, 2, 3):
        raise CheckpointError(
            f"export to DeepSpeed at zero_stage={zero_stage} is not supported: DeepSpeed's "
            "ZeRO checkpoints have stage 1, 2 or 3 layouts (for stage 0, export at stage 1 "
            "and load it with load_optimizer_states=False, or take the weights with "
            "zero_to_fp32)"
        )
    # A tensor-parallel checkpoint goes out at TP 1 (DeepSpeed's mp_rank_00): full tensors.
    reader = tp_view(CheckpointReader(resolve_tag_dir(checkpoint)), None)
    m = reader.manifest
    order: list[list[str]] | None = m.get("param_order")
    if order is None:
        raise CheckpointError(
            f"{reader.dir / 'manifest.json'} has no 'param_order' (saved by an older "
            "slipstream): load it and save it again, then export"
        )
    if m.get("moe_ep_sizes"):
        raise CheckpointError(
            f"{reader.dir} was saved with MoE expert parallelism (ep_size "
            f"{m['moe_ep_sizes']}): export to DeepSpeed is not built for it; load it at "
            "ep_size 1 and save again, or take the weights with zero_to_fp32"
        )
    world = world_size or int(m["dp_world_size"])
    tag = tag or reader.dir.name
    out = Path(out_dir)
    tmp = out / f".{tag}.export-tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        ds_config: dict[str, Any] = {"zero_optimization": {"stage": zero_stage}}
        if zero_stage == 3:
            ds_config["zero_optimization"]["sub_group_size"] = sub_group_size
            _write_zero3(reader, order, world, ds_config, tmp)
        else:
            for r, state in enumerate(_optimizer_files(reader, order, world, zero_stage)):
                name = f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
                wrapped = {"optimizer_state_dict": state, "ds_config": ds_config}
                torch.save(dict(wrapped, ds_version=DS_VERSION), tmp / name)
            states = _model_states(reader, order, world, ds_config)
            torch.save(states, tmp / "mp_rank_00_model_states.pt")
    finally:
        reader.close()
    target = out / tag
    if target.exists():
        shutil.rmtree(tmp)
        raise CheckpointError(f"{target} exists: choose another output directory or tag")
    os.replace(tmp, target)
    atomic_write_text(out / "latest", tag)
    return target


def _master(reader: LogicalReader, name: str) -> torch.Tensor:
    source = f"master/{name}" if reader.has(f"master/{name}") else f"model/{name}"
    return reader.read(source).float()


def _optimizer_files(
    reader: LogicalReader, order: list[list[str]], world: int, stage: int
) -> list[dict[str, Any]]:
    """Each rank's ``optimizer_state_dict`` as DeepSpeed's ZeRO-1/2 ``state_dict`` holds it."""
    m = reader.manifest
    keys: list[str] = m.get("optim_keys", [])
    scalars = m.get("optim_scalars", {})
    ranks: list[dict[str, Any]] = [
        {
            "zero_stage": stage,
            "partition_count": [world] * len(order),
            "group_paddings": [],
            "param_alignment_paddings": [[0] * len(g) for g in order],
            "single_partition_of_fp32_groups": [],
            "ds_version": DS_VERSION,
            "base_optimizer_state": {"state": {}, "param_groups": []},
        }
        for _ in range(world)
    ]
    for g, names in enumerate(order):
        total = sum(reader.numel(f"model/{n}") for n in names)
        padded = math.ceil(total / (2 * world)) * (2 * world)
        size = padded // world

        def flat(read: Any, names: list[str] = names, padded: int = padded) -> torch.Tensor:
            parts = [read(n) for n in names]
            return torch.cat([*parts, torch.zeros(padded - sum(p.numel() for p in parts))])

        fp32 = flat(lambda n: _master(reader, n))
        states = {k: flat(lambda n, k=k: reader.read(f"optim/{k}/{n}").float()) for k in keys}
        group = {
            k: (tuple(v) if isinstance(v, list) else v) for k, v in m["param_groups"][g].items()
        }
        saved = scalars.get(str(g), {})
        step = float(saved["step"]["value"]) if "step" in saved else None
        group.setdefault("bias_correction", True)  # DeepSpeed's FusedAdam reads it
        for r in range(world):
            pad = max(0, min(size, (r + 1) * size - total))
            lo, hi = r * size, (r + 1) * size
            ranks[r]["group_paddings"].append(pad)
            ranks[r]["single_partition_of_fp32_groups"].append(fp32[lo : hi - pad].clone())
            state: dict[str, Any] = {k: v[lo:hi].clone() for k, v in states.items()}
            if step is not None:
                state["step"] = torch.tensor(step)
            ranks[r]["base_optimizer_state"]["state"][g] = state
            ranks[r]["base_optimizer_state"]["param_groups"].append(dict(group, params=[g]))
    return ranks


def _model_states(
    reader: LogicalReader,
    order: list[list[str]],
    world: int,
    ds_config: dict[str, Any],
    partitioned: bool = False,
) -> dict[str, Any]:
    """The model-states dict; ``partitioned`` (ZeRO-3): every parameter an empty placeholder,
    as DeepSpeed saves a partitioned module."""
    m = reader.manifest
    trained = {n for g in order for n in g}
    module: OrderedDict[str, torch.Tensor] = OrderedDict()
    for name in reader.names("model"):
        source = f"model/{name}"
        if partitioned:
            module[name] = torch.empty(0, dtype=reader.dtype(source))
        else:
            module[name] = reader.read(source).reshape(reader.shape(source))
    buffers = reader.names("buffer")
    for name in buffers:
        module[name] = reader.read_full(f"buffer/{name}")
    extra = reader.load_object("extra.pt")
    state = {
        "module": module,
        "buffer_names": buffers,
        "optimizer": None,
        "param_shapes": [
            OrderedDict((n, torch.Size(reader.shape(f"model/{n}"))) for n in g) for g in order
        ],
        "frozen_param_shapes": {
            n: torch.Size(reader.shape(f"model/{n}"))
            for n in module
            if n not in trained and n not in buffers
        },
        "shared_params": {},
        "frozen_param_fragments": {},
        "lr_scheduler": extra["lr_scheduler"],
        "data_sampler": None,
        "random_ltd": None,
        "skipped_steps": m["skipped_steps"],
        "global_steps": m["global_steps"],
        "global_samples": m["global_samples"],
        "dp_world_size": world,
        "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_config": ds_config,
        "ds_version": DS_VERSION,
    }
    client = extra["client_state"] or {}
    clash = sorted(set(client) & set(state))
    if clash:
        raise CheckpointError(f"client_state keys {clash} collide with DeepSpeed's own keys")
    state.update(client)
    return state


# ----------------------------------------------------------------------------- ZeRO-3
def _zero3_sub_groups(
    reader: LogicalReader, names: list[str], world: int, limit: int
) -> list[list[str]]:
    """A param group's parameters cut as DeepSpeed's stage 3 cuts them (its
    ``_create_fp16_sub_groups``): by the per-rank partition sizes, a sub-group closed once it
    holds ``limit`` elements or more."""
    per_rank = [math.ceil(reader.numel(f"model/{n}") / world) for n in names]
    if limit >= sum(per_rank):
        return [names]
    out: list[list[str]] = [[]]
    size = 0
    for i, (name, n) in enumerate(zip(names, per_rank)):
        out[-1].append(name)
        size += n
        if size >= limit and i < len(names) - 1:
            out.append([])
            size = 0
    return out


def _zero3_piece(reader: LogicalReader, tensor: str, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s piece of ``tensor`` as DeepSpeed partitions a stage-3 parameter:
    ``ceil(numel / world)`` elements each, the last piece padded with zeros."""
    numel = reader.numel(tensor)
    per = math.ceil(numel / world)
    lo, hi = min(rank * per, numel), min((rank + 1) * per, numel)
    piece = reader.read(tensor, lo, hi).float() if hi > lo else torch.empty(0)
    return torch.cat([piece.reshape(-1), torch.zeros(per - (hi - lo))])


def _write_zero3(
    reader: LogicalReader,
    order: list[list[str]],
    world: int,
    ds_config: dict[str, Any],
    out: Path,
) -> None:
    """Every rank's model-states and optimizer-states files of DeepSpeed's ZeRO-3 layout."""
    m = reader.manifest
    scaler = m.get("loss_scaler") or {"scale": 1.0}
    if "cur_hysteresis" in scaler:
        raise CheckpointError(
            f"{reader.dir} was trained with fp16 and a dynamic loss scale: export to DeepSpeed's "
            "ZeRO-3 layout writes a static loss scaler only; export at stage 1 or 2"
        )
    limit = int(ds_config["zero_optimization"]["sub_group_size"])
    subs = [_zero3_sub_groups(reader, names, world, limit) for names in order]
    keys: list[str] = m.get("optim_keys", [])
    scalars = m.get("optim_scalars", {})
    common = _model_states(reader, order, world, ds_config, partitioned=True)
    for r in range(world):
        flats: list[torch.Tensor] = []
        state: dict[int, dict[str, Any]] = {}
        groups = []
        for g, cuts in enumerate(subs):
            ids = []
            step = scalars.get(str(g), {}).get("step")
            for names in cuts:
                sid = len(flats)
                ids.append(sid)
                source = [
                    f"master/{n}" if reader.has(f"master/{n}") else f"model/{n}" for n in names
                ]
                flats.append(torch.cat([_zero3_piece(reader, t, r, world) for t in source]))
                state[sid] = {
                    k: torch.cat([_zero3_piece(reader, f"optim/{k}/{n}", r, world) for n in names])
                    for k in keys
                }
                if step is not None:
                    state[sid]["step"] = torch.tensor(float(step["value"]))
            group = {
                k: (tuple(v) if isinstance(v, list) else v) for k, v in m["param_groups"][g].items()
            }
            group.setdefault("bias_correction", True)  # DeepSpeed's FusedAdam reads it
            groups.append(dict(group, params=ids))
        optimizer = {
            "zero_stage": 3,
            "loss_scaler": DeepSpeedObject(
                "deepspeed.runtime.fp16.loss_scaler",
                "LossScaler",
                {"cur_scale": float(scaler["scale"]), "dynamic": False},
            ),
            "dynamic_loss_scale": False,
            "overflow": False,
            "partition_count": world,
            "optimizer_state_dict": {"state": state, "param_groups": groups},
            "fp32_flat_groups": flats,
        }
        name = f"zero_pp_rank_{r}_mp_rank_00"
        wrapped = {"optimizer_state_dict": optimizer, "ds_config": ds_config}
        save_file(dict(wrapped, ds_version=DS_VERSION), out / f"{name}_optim_states.pt")
        fragments = {
            n: _zero3_piece(reader, f"model/{n}", r, world).to(reader.dtype(f"model/{n}"))
            for n in common["frozen_param_shapes"]
        }
        save_file(dict(common, frozen_param_fragments=fragments), out / f"{name}_model_states.pt")
