"""DeepSpeed's pipeline-parallel checkpoints (``deepspeed.pipe.PipelineModule``), read as one.

A ``PipelineEngine`` checkpoint of ``pp`` stages holds::

    layer_<ii>-model_states.pt                      layer ii's own state dict (``weight``...),
                                                    written by the stage that owns it
    mp_rank_<ss>_model_states.pt                    stage ss's counters, client state and, at
                                                    stage 0, its optimizer's state dict (the
                                                    module is None: the weights are the layers')
    zero_pp_rank_<r>_mp_rank_<ss>_optim_states.pt   ZeRO-1: stage ss's partitions, as
                                                    ``from_deepspeed`` reads them

The module's parameter names are ``<layer index>.<key>`` (DeepSpeed's ``PipelineModule``
registers layer ``i`` as submodule ``"i"``; slipstream's does the same, and so does an
``nn.Sequential`` of the same layers). Which layers a stage holds is not written down: the
layers are given to the stages in order, each stage taking as many parameters as its
optimizer holds (ZeRO: its ``param_shapes``, which must then name exactly those parameters;
without ZeRO: its optimizer state dict, whose states must have the parameters' shapes). Each
stage is then read by ``DeepSpeedReader`` as a checkpoint of its own.

Refused, naming the file: tensor-parallel layer files (``layer_<ii>-model_<tt>-...``), a
stage's missing files, and MoE or ZeRO-3 files in a pipeline checkpoint. Tied layers
(``TiedLayerSpec``) are not read: DeepSpeed stores them under the layer index (or not at all),
so the load names the ``tied_modules.*`` parameters it misses.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

from slipstream.checkpoint.deepspeed_files import PipeStage, load_file
from slipstream.checkpoint.format import CheckpointError
from slipstream.checkpoint.from_deepspeed import DeepSpeedReader

__all__ = ["DeepSpeedPipeReader", "open_deepspeed"]

LAYER = re.compile(r"^layer_(\d+)-model_states\.pt$")
TP_LAYER = re.compile(r"^layer_\d+-model_\d+-model_states\.pt$")


def open_deepspeed(directory: str | os.PathLike[str]) -> DeepSpeedReader:
    """The reader for a DeepSpeed tag directory: pipeline-parallel or not."""
    names = os.listdir(directory)
    if any(LAYER.match(n) or TP_LAYER.match(n) for n in names):
        return DeepSpeedPipeReader(directory)
    return DeepSpeedReader(directory)


class DeepSpeedPipeReader(DeepSpeedReader):
    """Every stage of a DeepSpeed pipeline checkpoint through one reading interface.

    Raises:
        CheckpointError: naming the file for what cannot be read (see the module docstring).
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.dir = Path(directory)
        names = sorted(os.listdir(self.dir))
        self._refuse(names)
        first = load_file(self.dir / "mp_rank_00_model_states.pt")
        dims = first.get("checkpoint_parallel_dimensions") or {}
        pp = int(dims.get("pp_degree") or first.get("mp_world_size") or 1)
        states = []
        for s in range(pp):
            path = self.dir / f"mp_rank_{s:02d}_model_states.pt"
            if not path.is_file():
                raise CheckpointError(
                    f"{self.dir} lacks {path.name}: the checkpoint of a {pp}-stage pipeline "
                    "needs every stage's file; copy the whole tag directory"
                )
            states.append(load_file(path) if s else first)
        layers = sorted((int(m.group(1)), n) for n in names if (m := LAYER.match(n)))
        weights = [(i, load_file(self.dir / n)) for i, n in layers]
        buffers = sorted({b for ms in states for b in ms.get("buffer_names") or []})
        module = _assign(weights, states, set(buffers), self.dir)
        self._stages = [
            DeepSpeedReader(self.dir, PipeStage(s, module[s], buffers)) for s in range(pp)
        ]
        self._owner: dict[str, DeepSpeedReader] = {}
        self.tensors = {}
        for reader in self._stages:
            for t, entry in reader.tensors.items():
                self._owner[t] = reader
                self.tensors[t] = entry
        lead = self._stages[0]
        self.where = f"DeepSpeed pipeline checkpoint {self.dir}"
        self.model_states, self.ds_config = lead.model_states, lead.ds_config
        self._model_file = lead._model_file
        keys = sorted({k for r in self._stages for k in r.manifest["optim_keys"]})
        world = sum(r.manifest["world_size"] for r in self._stages)
        self.manifest = dict(lead.manifest, world_size=world, optim_keys=keys)

    def _refuse(self, names: list[str]) -> None:
        def refuse(name: str, why: str) -> None:
            raise CheckpointError(f"{self.dir / name}: {why}; slipstream cannot read it")

        for n in names:
            if TP_LAYER.match(n):
                refuse(n, "a tensor-parallel pipeline layer file (layer_<ii>-model_<tt>)")
            if "expert_" in n or (n.startswith("zero_pp_rank_") and n.endswith("_model_states.pt")):
                refuse(n, "a mixture-of-experts or ZeRO-3 file in a pipeline checkpoint")
        if "mp_rank_00_model_states.pt" not in names:
            raise CheckpointError(
                f"{self.dir} holds pipeline layer files but no mp_rank_00_model_states.pt: "
                "not a complete DeepSpeed pipeline checkpoint"
            )

    def _read_into(self, tensor: str, start: int, stop: int, out: torch.Tensor) -> None:
        self._owner[tensor]._read_into(tensor, start, stop, out)

    def close(self) -> None:
        for reader in self._stages:
            reader.close()


def _trained(ms: dict[str, Any], path: Path) -> list[str] | int:
    """A stage's trained parameters: their names (ZeRO's ``param_shapes`` and frozen ones), or
    without ZeRO their number (the optimizer's; 0 without an optimizer)."""
    shapes = ms.get("param_shapes")
    if shapes:
        frozen = list(ms.get("frozen_param_shapes") or {})
        return [n for group in shapes for n in group] + frozen
    sd = ms.get("optimizer")
    if sd is None:
        return 0
    sd = sd.get("optimizer_state_dict", sd)  # DeepSpeed's FP16_Optimizer wrapper
    if "param_groups" not in sd:
        raise CheckpointError(f"{path} key 'optimizer' is not a torch optimizer state dict")
    return sum(len(g["params"]) for g in sd["param_groups"])


def _assign(
    weights: list[tuple[int, dict[str, torch.Tensor]]],
    states: list[dict[str, Any]],
    buffers: set[str],
    directory: Path,
) -> list[dict[str, torch.Tensor]]:
    """The layers' weights given to the stages in order, each taking as many parameters as
    its optimizer holds; a ZeRO stage's must be the ones its ``param_shapes`` names."""
    want = [
        _trained(ms, directory / f"mp_rank_{s:02d}_model_states.pt") for s, ms in enumerate(states)
    ]
    limits = [w if isinstance(w, int) else len(w) for w in want]
    out: list[dict[str, torch.Tensor]] = [{} for _ in states]
    stage, taken = 0, 0
    for idx, state in weights:
        params = [f"{idx}.{k}" for k in state if f"{idx}.{k}" not in buffers]
        while params and taken >= limits[stage] and stage < len(states) - 1:
            stage, taken = stage + 1, 0
        out[stage].update({f"{idx}.{k}": v for k, v in state.items()})
        taken += len(params)
    for s, names in enumerate(want):
        if isinstance(names, int):
            _check_shapes(states[s], [v for n, v in out[s].items() if n not in buffers], directory)
        got = sorted(n for n in out[s] if n not in buffers)
        if (isinstance(names, list) and got != sorted(names)) or len(got) != limits[s]:
            raise CheckpointError(
                f"{directory / f'mp_rank_{s:02d}_model_states.pt'}: its optimizer holds "
                f"{sorted(names)[:8] if isinstance(names, list) else names} parameters but the "
                f"layer files give this stage {got[:8]}: the layer files do not belong to this "
                "checkpoint (or hold frozen parameters, which a pipeline without ZeRO does not "
                "record); load with DeepSpeed and save at ZeRO-1"
            )
    return out


def _check_shapes(ms: dict[str, Any], params: list[torch.Tensor], directory: Path) -> None:
    """Without ZeRO, a stage's optimizer states (in parameter order) have the shapes of the
    parameters its layers were given, or the assignment is wrong: an error."""
    sd = ms.get("optimizer")
    if sd is None:
        return
    sd = sd.get("optimizer_state_dict", sd)
    ids = [i for g in sd["param_groups"] for i in g["params"]]
    for i, p in zip(ids, params):
        for key, v in sd["state"].get(i, {}).items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape != p.shape:
                raise CheckpointError(
                    f"{directory}: a stage's optimizer state '{key}' of shape {tuple(v.shape)} "
                    f"falls on a parameter of shape {tuple(p.shape)}: the layer files do not "
                    "belong to this checkpoint (or hold frozen parameters, which a pipeline "
                    "without ZeRO does not record); load with DeepSpeed and save at ZeRO-1"
                )
