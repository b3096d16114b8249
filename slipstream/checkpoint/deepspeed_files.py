"""DeepSpeed's checkpoint files: their names, detection, and reading them without DeepSpeed.

DeepSpeed pickles a few of its own classes into its checkpoint files (the loss scaler, the
ZeRO stage enum, fragment addresses). ``load_file`` reads every file memory-mapped and turns those
classes into plain stand-ins, so DeepSpeed need not be installed. ``Flat`` and ``Fragment``
describe a rank's flat partition space, which ``from_deepspeed.DeepSpeedReader`` and
``to_deepspeed`` lay parameters out in.
"""

from __future__ import annotations

import bisect
import os
import pickle
import re
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from slipstream.checkpoint.format import MANIFEST, CheckpointError

MODEL_STATES = "mp_rank_00_model_states.pt"
UNIVERSAL_STATE = "optimizer_state.pt"
ZERO3_MODEL_FILE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
OPTIM_FILE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
LAYER_FILE = re.compile(r"^layer_\d+-model_states\.pt$")
# What DeepSpeed's load_checkpoint keeps out of the client state it returns (the rest of the
# model-states dict is returned, DeepSpeed's own keys included, as DeepSpeed does).
DS_STATE_KEYS = (
    "module",
    "skipped_steps",
    "global_steps",
    "dp_world_size",
    "mp_world_size",
    "data_sampler",
    "random_ltd",
    "lr_scheduler",
    "optimizer",
)


def is_deepspeed_tag(directory: Path) -> bool:
    """Whether ``directory`` is a tag directory DeepSpeed wrote (and not a slipstream one)."""
    if not directory.is_dir() or (directory / MANIFEST).is_file():
        return False
    return any(
        n.endswith(("_model_states.pt", "-model_states.pt", "_optim_states.pt")) or n == "zero"
        for n in os.listdir(directory)
    )


@dataclass(frozen=True)
class PipeStage:
    """One pipeline stage of a DeepSpeed ``PipelineModule`` checkpoint: its files are the
    ``mp_rank_<mp_rank>`` ones, its module state dict (``None`` in the files) is ``module``
    (the weights of its layer files, ``<layer index>.<key>``), ``buffers`` the buffer names."""

    mp_rank: int
    module: dict[str, torch.Tensor]
    buffers: list[str]


# ----------------------------------------------------------------------------- unpickling
class StandIn:
    """A DeepSpeed object in a checkpoint pickle, kept as its constructor arguments and state
    (``args``, attributes): enough to read the loss scaler, the stage enum and fragment
    addresses without importing DeepSpeed."""

    _ds_class = ""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args
        self.__dict__.update(kwargs)

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
            state = {**(state[0] or {}), **state[1]}  # (dict, slots)
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.state = state

    @property
    def value(self) -> Any:
        """An enum member's value (``ZeroStageEnum(2)`` is pickled as a call with ``2``)."""
        return self.args[0] if self.args else self.__dict__.get("_value_")


_STAND_INS: dict[str, type] = {}


def _stand_in(module: str, name: str) -> type:
    key = f"{module}.{name}"
    if key not in _STAND_INS:
        _STAND_INS[key] = type(name, (StandIn,), {"_ds_class": key})
    return _STAND_INS[key]


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "deepspeed" or module.startswith("deepspeed."):
            return _stand_in(module, name)
        return super().find_class(module, name)


_PICKLE = types.ModuleType("slipstream_deepspeed_pickle")
_PICKLE.Unpickler = _Unpickler  # type: ignore[attr-defined]
_PICKLE.load = lambda f, **kw: _Unpickler(f, **kw).load()  # type: ignore[attr-defined]


@dataclass(frozen=True)
class DeepSpeedObject:
    """A DeepSpeed object to write into a checkpoint pickle without importing DeepSpeed:
    its class (``module``, ``name``) and its ``__dict__``. DeepSpeed unpickles it as that
    class (``cls.__new__(cls)``, then ``__dict__`` updated), as ``pickle`` stores it."""

    module: str
    name: str
    state: dict[str, Any]


class _Pickler(pickle._Pickler):  # the Python pickler: its ``save`` can be extended
    write: Callable[[bytes], Any]  # set by pickle._Pickler.__init__ (not in typeshed)

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        save = pickle._Pickler.save  # type: ignore[attr-defined]
        if isinstance(obj, DeepSpeedObject):
            self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
            self.write(pickle.EMPTY_TUPLE + pickle.NEWOBJ)
            save(self, obj.state)
            self.write(pickle.BUILD)
            return
        save(self, obj, save_persistent_id)


_PICKLE.Pickler = _Pickler  # type: ignore[attr-defined]


def save_file(obj: dict[str, Any], path: Path) -> None:
    """``torch.save`` of ``obj``, with its ``DeepSpeedObject`` values as DeepSpeed's classes."""
    torch.save(obj, path, pickle_module=_PICKLE)


def load_file(path: Path) -> dict[str, Any]:
    """One DeepSpeed file (memory-mapped), every failure a ``CheckpointError`` naming it."""
    if not path.is_file():
        raise CheckpointError(f"DeepSpeed checkpoint file {path} is missing")
    try:
        obj = torch.load(
            path, map_location="cpu", weights_only=False, mmap=True, pickle_module=_PICKLE
        )
    except Exception as e:  # a truncated zip, a foreign pickle: name the file
        raise CheckpointError(f"cannot read DeepSpeed checkpoint file {path}: {e}") from e
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path} holds a {type(obj).__name__}, not DeepSpeed's state dict")
    return obj


def require_key(obj: dict[str, Any], key: str, path: Path) -> Any:
    if key not in obj:
        raise CheckpointError(
            f"DeepSpeed checkpoint file {path} has no key '{key}' (keys: {sorted(obj)[:12]}): "
            "it was not written by DeepSpeed's ZeRO optimizer of a version slipstream reads "
            "(0.10 or later)"
        )
    return obj[key]


def stage_of(value: Any) -> int:
    return int(value.value if isinstance(value, StandIn) else value)


# ----------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class Fragment:
    """Elements ``[start, start + numel)`` of a parameter lie at ``local`` in rank ``rank``'s
    flat space (its groups' tensors end to end)."""

    rank: int
    local: int
    start: int
    numel: int


class Flat:
    """A rank's groups of one kind (fp32 master or one optimizer state) as one flat space:
    ``bases[g]`` is where group ``g`` starts (tensors may be shorter than the space between
    bases: DeepSpeed strips the tail padding of some)."""

    def __init__(self, bases: list[int], tensors: list[torch.Tensor], what: str) -> None:
        self.bases, self.tensors, self.what = bases, [t.reshape(-1) for t in tensors], what

    def read(self, local: int, numel: int) -> torch.Tensor:
        g = bisect.bisect_right(self.bases, local) - 1
        offset = local - self.bases[g]
        t = self.tensors[g]
        if offset + numel > t.numel():
            raise CheckpointError(
                f"{self.what} holds {t.numel()} elements in group {g}, fewer than the "
                f"{offset + numel} the parameter layout needs: the files do not belong together"
            )
        return t[offset : offset + numel]


# ----------------------------------------------------------------------------- states
def train_dtype(ds_config: dict[str, Any]) -> torch.dtype:
    for key, dtype in (("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16)):
        if (ds_config.get(key) or {}).get("enabled"):
            return dtype
    if (ds_config.get("fp16") or {}).get("enabled"):
        return torch.float16
    return torch.float32


def stage0_masters(sd: dict[str, Any], path: Path) -> list[torch.Tensor]:
    """FP16_Optimizer's fp32 masters in parameter order: per parameter (the unfused one's
    ``fp32_groups``) or one flat tensor per group (the fused one's ``fp32_groups_flat``)."""
    if "fp32_groups" in sd:
        return [t for group in sd["fp32_groups"] for t in group]
    return list(require_key(sd, "fp32_groups_flat", path))


def base_state(osd: dict[str, Any], path: Path) -> tuple[list[dict[str, Any]], list[Any]]:
    """(per group optimizer state, param groups) of a ZeRO file's base optimizer."""
    if "base_optimizer_state" in osd:
        base = osd["base_optimizer_state"]
        if isinstance(base, list):  # elastic_checkpoint: per-group states without padding
            step = osd.get("base_optimizer_state_step")
            states = [dict(s, step=s.get("step", step)) for s in base]
            return states, [{} for _ in base]
    else:
        base = require_key(osd, "optimizer_state_dict", path)
    state, groups = require_key(base, "state", path), require_key(base, "param_groups", path)
    ids = [i for g in groups for i in g["params"]]
    return [state.get(i, {}) for i in ids], groups


def state_keys(states: list[dict[str, Any]]) -> list[str]:
    return sorted(
        {k for s in states for k, v in s.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
    )


def per_group_scalars(
    states: list[dict[str, Any]], n_groups: int, path: Path
) -> dict[str, dict[str, Any]]:
    """Per-group scalar states (Adam's ``step``) in the manifest's terms; DeepSpeed keeps one
    per flat group, and every group must agree (DeepSpeed asserts the same)."""
    found: dict[str, set[Any]] = {}
    for state in states:
        for k, v in state.items():
            if not (isinstance(v, torch.Tensor) and v.dim() > 0):
                found.setdefault(k, set()).add(v.item() if isinstance(v, torch.Tensor) else v)
    one: dict[str, Any] = {}
    for k, values in found.items():
        if len(values) > 1:
            raise CheckpointError(f"{path}: optimizer state '{k}' differs between groups: {values}")
        value = values.pop()
        # torch's Adam keeps ``step`` as a float32 tensor; DeepSpeed's FusedAdam as an int.
        one[k] = {"value": float(value), "tensor": True, "dtype": "float32"}
    return {str(g): dict(one) for g in range(n_groups)}
