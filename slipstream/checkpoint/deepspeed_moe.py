"""DeepSpeed's mixture-of-experts checkpoint files, and where each expert's partitions lie.

``deepspeed.moe.layer.MoE`` makes DeepSpeed's ``save_checkpoint`` write, beside the usual files:

- ``layer_<l>_expert_<e>_mp_rank_00_model_states.pt``: the weights of global expert ``e`` of
  the ``l``-th MoE layer (in module order), under their state-dict names with the global id
  (``...deepspeed_experts.<e>...``). The module state dict in ``mp_rank_00_model_states.pt``
  leaves every expert out.
- At ZeRO-1/2, each optimizer param group marked ``moe`` (named ``ep_size_<n>``) holds the
  experts of the rank's expert-parallel rank under their *local* ids (``param_shapes`` lists
  rank 0's), partitioned over its expert-data-parallel group: ``world / ep_size`` ranks.

DeepSpeed places ranks as its ``groups._create_expert_and_data_parallel`` does (one pipeline
stage, no model parallelism): by default expert-parallel rank ``r % ep_size`` and
expert-data-parallel rank ``r // ep_size``; with ``use_data_before_expert_parallelism`` the
expert-parallel rank is ``r // (world / ep_size)`` and the data-parallel one ``r % (world /
ep_size)`` (Rajbhandari et al., DeepSpeed-MoE, section 5.2: experts are data-parallel over
``world / ep_size`` ranks).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from slipstream.checkpoint.deepspeed_files import load_file
from slipstream.checkpoint.format import CheckpointError

__all__ = ["EXPERT_FILE", "ExpertLayout", "read_expert_files", "stage0_expert_states"]

EXPERT_FILE = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")
"""One expert's weights (DeepSpeed 0.6 and later)."""
OLD_EXPERT_FILE = re.compile(r"^expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")
"""Before DeepSpeed 0.6: every layer's expert ``e`` in one file (not read)."""
EXPP_FILE = re.compile(r"^expp_rank_(\d+)_mp_rank_00_optim_states\.pt$")
"""Without ZeRO: the optimizer state dict of expert-parallel rank ``e``."""
EXPERT_ID = re.compile(r"deepspeed_experts\.(\d+)\.")


@dataclass(frozen=True)
class ExpertLayout:
    """Where DeepSpeed put the experts of a run of ``world`` data-parallel ranks.

    Attributes:
        world: data-parallel ranks of the DeepSpeed run.
        data_before_expert: ``use_data_before_expert_parallelism`` was on.
        layer_experts: each MoE layer's experts, by the name prefix of its expert modules
            (``...deepspeed_experts.``), from the expert files.
    """

    world: int
    data_before_expert: bool
    layer_experts: dict[str, int]

    def rank(self, ep_size: int, ep_rank: int, edp_rank: int) -> int:
        """The global rank at expert-parallel rank ``ep_rank`` and expert-data-parallel rank
        ``edp_rank`` of the ``ep_size`` groups."""
        if self.data_before_expert:
            return ep_rank * (self.world // ep_size) + edp_rank
        return ep_rank + ep_size * edp_rank

    def global_name(self, local_name: str, ep_size: int, ep_rank: int, where: Path) -> str:
        """``local_name`` (an expert parameter under its id on ``ep_rank``) with the global id."""
        matches = list(EXPERT_ID.finditer(local_name))
        if not matches:
            raise CheckpointError(
                f"{where}: parameter '{local_name}' of an expert param group is not inside a "
                "deepspeed.moe layer's experts (no 'deepspeed_experts.<i>.' in its name)"
            )
        m = matches[-1]
        prefix = local_name[: m.start(1)]
        total = self.layer_experts.get(prefix)
        if total is None or total % ep_size:
            raise CheckpointError(
                f"{where}: the expert files hold {total or 0} experts for '{prefix}*' "
                f"(layer_<l>_expert_<e>_*.pt), which ep_size {ep_size} does not divide: "
                "copy the whole tag directory"
            )
        gid = ep_rank * (total // ep_size) + int(m.group(1))
        return f"{prefix}{gid}{local_name[m.end(1) :]}"


def read_expert_files(
    directory: Path, names: list[str], num_experts: list[int] | None
) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """Every expert weight of the ``layer_*_expert_*`` files (by its global name) and each
    layer's number of experts (by the name prefix of its experts). ``num_experts`` is the
    model-states file's list (one entry per MoE layer), when it has one.

    Raises:
        CheckpointError: a file of another model-parallel rank, a gap in a layer's expert ids,
            or a file whose keys are not that expert's.
    """
    weights: dict[str, torch.Tensor] = {}
    layers: dict[int, set[int]] = {}
    prefixes: dict[str, set[int]] = {}
    files = sorted(
        (int(m.group(1)), int(m.group(2)), n) for n in names if (m := EXPERT_FILE.match(n))
    )
    for layer, expert, n in files:  # by layer, then expert id (the module's order)
        layers.setdefault(layer, set()).add(expert)
        state = load_file(directory / n)
        for key, value in state.items():
            found = list(EXPERT_ID.finditer(key))
            if (
                not found
                or int(found[-1].group(1)) != expert
                or not isinstance(value, torch.Tensor)
            ):
                raise CheckpointError(
                    f"{directory / n} holds '{key}', which is not a tensor of expert {expert}: "
                    "not a file DeepSpeed's MoE layer wrote"
                )
            prefixes.setdefault(key[: found[-1].start(1)], set()).add(expert)
            weights[key] = value
    for layer, ids in sorted(layers.items()):
        want = num_experts[layer] if num_experts and layer < len(num_experts) else len(ids)
        if ids != set(range(want)):
            missing = sorted(set(range(max(want, max(ids) + 1))) - ids)
            raise CheckpointError(
                f"{directory} lacks the expert files of layer {layer}, experts {missing} "
                f"(layer_{layer}_expert_<e>_mp_rank_00_model_states.pt): copy the whole tag "
                "directory"
            )
    return weights, {p: len(ids) for p, ids in prefixes.items()}


def stage0_expert_states(
    directory: Path, fp32: bool, dense: list[str], experts: dict[str, torch.Tensor]
) -> tuple[dict[str, Any], list[str]]:
    """Without ZeRO, DeepSpeed saves the optimizer of each expert-parallel rank ``e`` in
    ``expp_rank_<e>_mp_rank_00_optim_states.pt``: the ``dense`` parameters' states (equal on
    every rank), then its local experts' (param groups marked ``moe``), in module order.
    Returns one torch optimizer state dict over every parameter and the parameter names in
    its id order (experts by global name).

    Raises:
        CheckpointError: a missing rank file, bf16/fp16 (DeepSpeed's FP16_Optimizer wrapper),
            or expert groups of more than one ``ep_size``.
    """
    names = os.listdir(directory)
    files = sorted((int(m.group(1)), n) for n in names if (m := EXPP_FILE.match(n)))
    ep = len(files)
    if not fp32 or [e for e, _ in files] != list(range(ep)):
        raise CheckpointError(
            f"{directory}: the expp_rank_<e>_mp_rank_00_optim_states.pt files ({names}) are not "
            "those of an fp32 run without ZeRO (ranks 0 to ep_size-1); slipstream reads a "
            "mixture-of-experts run without ZeRO in fp32 only: load with "
            "load_optimizer_states=False after removing them, or save at ZeRO stage 1 or 2"
        )
    state: dict[int, Any] = {}
    groups: list[dict[str, Any]] = []
    order: list[str] = []
    for e, n in files:
        path = directory / n
        sd = load_file(path).get("optimizer")
        if not isinstance(sd, dict) or "param_groups" not in sd:
            raise CheckpointError(f"{path} key 'optimizer' is not a torch optimizer state dict")
        sizes = {str(g.get("name")) for g in sd["param_groups"] if g.get("moe")}
        if sizes != {f"ep_size_{ep}"}:
            raise CheckpointError(
                f"{path}: expert param groups {sorted(sizes)} for {ep} expp_rank files: "
                "slipstream reads one ep_size, that of the files"
            )
        mine = _local_experts(experts, e, ep)
        for g, group in enumerate(sd["param_groups"]):
            if e and not group.get("moe"):
                continue  # the dense states: rank 0's
            params = dense if not group.get("moe") else mine
            if len(group["params"]) != len(params):
                raise CheckpointError(
                    f"{path}: param group {g} holds {len(group['params'])} parameters but "
                    f"the {'expert' if group.get('moe') else 'model-states'} files give "
                    f"{len(params)}"
                )
            new = list(range(len(order), len(order) + len(params)))
            state.update(
                {n_: sd["state"][i] for n_, i in zip(new, group["params"]) if i in sd["state"]}
            )
            order.extend(params)
            # One expert group over every rank's experts (the ranks' groups are copies).
            same = [x for x in groups if x.get("moe") and x.get("name") == group.get("name")]
            if same and group.get("moe"):
                same[0]["params"] = same[0]["params"] + new
            else:
                groups.append(dict(group, params=new))
    return {"state": state, "param_groups": groups}, order


def _local_experts(experts: dict[str, torch.Tensor], ep_rank: int, ep_size: int) -> list[str]:
    """The global names of expert-parallel rank ``ep_rank``'s expert weights, in module order."""
    counts: dict[str, int] = {}
    for name in experts:
        m = list(EXPERT_ID.finditer(name))[-1]
        counts[name[: m.start(1)]] = max(counts.get(name[: m.start(1)], 0), int(m.group(1)) + 1)
    out = []
    for name in experts:
        m = list(EXPERT_ID.finditer(name))[-1]
        local = counts[name[: m.start(1)]] // ep_size
        if ep_rank * local <= int(m.group(1)) < (ep_rank + 1) * local:
            out.append(name)
    return out
