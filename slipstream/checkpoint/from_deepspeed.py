"""Read a checkpoint DeepSpeed wrote, as the logical tensors of a slipstream checkpoint.

A user moving a running job from DeepSpeed has a tag directory such as ``global_step100/``::

    mp_rank_00_model_states.pt                      module state dict (full at stages 0-2),
                                                    parameter order and shapes, step counters,
                                                    lr scheduler, client state
    zero_pp_rank_<r>_mp_rank_00_model_states.pt     the same per rank at stage 3 (the module's
                                                    parameters there are empty; frozen ones are
                                                    per-rank fragments)
    [bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt
                                                    rank r's fp32 master partition and its
                                                    optimizer states (``bf16_`` with bf16 on)

``DeepSpeedReader`` presents such a directory through the reading interface of
``CheckpointReader`` (``model/``, ``master/``, ``optim/<key>/`` and ``buffer/`` logical
tensors, ranges of them, a manifest with the counters), so the one restore path of ``state``
puts it into an engine of any world size and ZeRO stage, and ``convert`` writes it as a
slipstream checkpoint. The layouts, as DeepSpeed 0.19's ZeRO optimizers write them:

- **Stages 1 and 2**: per param group, the parameters (in ``param_shapes`` order) are laid
  end to end, each followed by its ``param_alignment_paddings`` entry, and the whole is padded
  to a multiple of ``2 * world``; rank ``r`` holds elements ``[r * P, (r + 1) * P)`` (``P`` is
  the padded partition). The fp32 partition is saved without its tail padding
  (``group_paddings``), the optimizer states with it.
- **Stage 3**: every parameter is split on its own into ``ceil(numel / world)`` elements per
  rank (the last one padded); rank ``r``'s flat groups hold its piece of each parameter, in
  ``param_shapes`` order, concatenated over the (sub-)groups.
- **Stage 0**: the module state dict holds the weights and ``optimizer`` the optimizer's own
  state dict (with bf16/fp16 inside DeepSpeed's FP16_Optimizer, beside the fp32 masters).

Every file is opened memory-mapped, so reading a range costs only its pages. DeepSpeed pickles
a few of its own classes into these files (the loss scaler, the stage enum, fragment
addresses): they are read as plain stand-ins, so DeepSpeed need not be installed.

- **Universal** (DeepSpeed's ``ds_to_universal.py``): ``zero/<name>/<state>.pt`` hold each
  parameter's fp32 master and optimizer states whole, ``zero/optimizer_state.pt`` the rest.

- **Mixture of experts** (``deepspeed.moe.layer.MoE``, ZeRO-0/1/2): ``layer_<l>_expert_<e>_*``
  files hold each expert's weights, the ZeRO files' expert param groups (or, without ZeRO,
  the ``expp_rank_<e>`` files) its master and states (``deepspeed_moe`` describes where).

Pipeline-parallel checkpoints (``layer_*-model_states.pt``) are read stage by stage by
``deepspeed_pipe``, each stage through this reader. Not read (each refused with an error naming
the file): model-parallel checkpoints (``mp_rank_01_*``), the expert files of DeepSpeed before
0.6, MoE optimizer states without ZeRO in bf16/fp16 and MoE at ZeRO-3.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

import torch

from slipstream.checkpoint.deepspeed_files import (
    DS_STATE_KEYS,
    LAYER_FILE,
    MODEL_STATES,
    OPTIM_FILE,
    UNIVERSAL_STATE,
    ZERO3_MODEL_FILE,
    Flat,
    Fragment,
    PipeStage,
    StandIn,
    base_state,
    is_deepspeed_tag,
    load_file,
    per_group_scalars,
    require_key,
    stage0_masters,
    stage_of,
    state_keys,
    train_dtype,
)
from slipstream.checkpoint.deepspeed_moe import (
    OLD_EXPERT_FILE,
    ExpertLayout,
    read_expert_files,
    stage0_expert_states,
)
from slipstream.checkpoint.format import CheckpointError, TensorTable, dtype_name

__all__ = ["DeepSpeedReader", "check_optimizer", "is_deepspeed_tag"]


class DeepSpeedReader(TensorTable):
    """A DeepSpeed tag directory through ``CheckpointReader``'s reading interface.

    Raises:
        CheckpointError: naming the file (and key) for what is missing, damaged or not
            readable (model/pipeline parallel checkpoints, the MoE files listed above).
    """

    def __init__(
        self, directory: str | os.PathLike[str], pipe_stage: PipeStage | None = None
    ) -> None:
        self.dir = Path(directory)
        names = sorted(os.listdir(self.dir))
        mp = 0 if pipe_stage is None else pipe_stage.mp_rank
        if pipe_stage is None:
            self._refuse_unsupported(names)
        else:  # one stage of a pipeline checkpoint (``deepspeed_pipe``): its own files only
            names = [n for n in names if f"mp_rank_{mp:02d}_" in n]
        zero3_models = sorted(
            (int(m.group(1)), n) for n in names if (m := ZERO3_MODEL_FILE.match(n)) is not None
        )
        optim = sorted(
            (int(m.group(2)), n) for n in names if (m := OPTIM_FILE.match(n)) is not None
        )
        model_file = self.dir / (zero3_models[0][1] if zero3_models else MODEL_STATES)
        if pipe_stage is not None:
            model_file = self.dir / f"mp_rank_{mp:02d}_model_states.pt"
        self.model_states = load_file(model_file)
        if pipe_stage is not None:
            self.model_states.update(module=pipe_stage.module, buffer_names=pipe_stage.buffers)
        self._model_file = model_file
        counts = self.model_states.get("num_experts")
        self._experts, self._layer_experts = read_expert_files(
            self.dir, names, counts if isinstance(counts, list) else None
        )
        self._full: dict[str, torch.Tensor] = {}
        self._frags: dict[str, tuple[str, list[Fragment]]] = {}
        self._flats: dict[tuple[int, str], Flat] = {}
        self.tensors = {}
        self.where = f"DeepSpeed checkpoint {self.dir}"
        self._scaler_state: Any = None  # the loss scaler (object or dict) where not in optim files
        ds_config = self.model_states.get("ds_config") or {}
        self.ds_config: dict[str, Any] = ds_config if isinstance(ds_config, dict) else {}
        self.train_dtype = train_dtype(self.ds_config)
        scalars: dict[str, dict[str, Any]] = {}
        param_groups: list[dict[str, Any]] = []
        stage = 0
        if (self.dir / "zero").is_dir():
            stage, scalars, param_groups = self._read_universal()
        elif optim:
            stage, scalars, param_groups = self._read_zero(optim, zero3_models)
        else:
            scalars, param_groups = self._read_stage0()
        self._read_module(stage)
        self.manifest = self._manifest(stage, optim, scalars, param_groups)

    # ------------------------------------------------------------ what is refused
    def _refuse_unsupported(self, names: list[str]) -> None:
        def refuse(name: str, why: str, fix: str) -> None:
            raise CheckpointError(f"{self.dir / name}: {why}; slipstream cannot read it. {fix}")

        for n in names:
            if LAYER_FILE.match(n):
                raise CheckpointError(
                    f"{self.dir / n}: a pipeline-parallel layer file; DeepSpeedReader reads one "
                    "stage. Open the directory with deepspeed_pipe.open_deepspeed (as "
                    "load_checkpoint and slipstream convert do)"
                )
            if OLD_EXPERT_FILE.match(n):
                refuse(
                    n,
                    "a mixture-of-experts file of DeepSpeed before 0.6 (every layer's expert in "
                    "one file)",
                    "Load it in a current DeepSpeed and save again (layer_<l>_expert_<e> files)",
                )
            if re.search(r"mp_rank_(?!00)\d+_", n):
                refuse(
                    n,
                    "a model-parallel (tensor-parallel) rank file",
                    "Consolidate it in DeepSpeed first (zero_to_fp32.py) and load the weights "
                    "with load_module_only",
                )
        zero = self.dir / "zero"
        if zero.is_dir() and not (zero / UNIVERSAL_STATE).is_file():
            refuse(
                "zero",
                f"a universal checkpoint folder without {UNIVERSAL_STATE} (ds_to_universal did "
                "not finish, or kept its per-TP-rank slices)",
                "Run DeepSpeed's ds_to_universal.py on the ZeRO checkpoint again",
            )
        if MODEL_STATES not in names and not any(ZERO3_MODEL_FILE.match(n) for n in names):
            raise CheckpointError(
                f"{self.dir} has no {MODEL_STATES} (nor zero_pp_rank_*_mp_rank_00_model_states"
                f".pt): not a complete DeepSpeed checkpoint (files: {names[:12]})"
            )

    # ------------------------------------------------------------ universal checkpoints
    def _read_universal(self) -> tuple[int, dict[str, dict[str, Any]], list[dict[str, Any]]]:
        """``zero/<name>/{fp32,exp_avg,...,step}.pt``: every parameter's master and states
        whole (DeepSpeed's ds_to_universal merged the partitions), ``zero/optimizer_state.pt``
        the rest of the optimizer's state."""
        path = self.dir / "zero" / UNIVERSAL_STATE
        common = load_file(path)
        stage = stage_of(require_key(common, "zero_stage", path))
        groups = list(require_key(common, "param_groups", path))
        shapes = require_key(self.model_states, "param_shapes", self._model_file)
        steps: list[dict[str, Any]] = []
        for group in shapes:
            for name in group:
                folder = self.dir / "zero" / name
                fp32 = require_key(load_file(folder / "fp32.pt"), "param", folder / "fp32.pt")
                self._full[f"master/{name}"] = fp32
                self._table(f"master/{name}", tuple(fp32.shape), torch.float32)
                for state in sorted(folder.glob("*.pt")):
                    key = state.stem
                    if key == "fp32":
                        continue
                    if key == "step":
                        steps.append({"step": torch.load(state, map_location="cpu")})
                        continue
                    value = require_key(load_file(state), "param", state)
                    self._full[f"optim/{key}/{name}"] = value
                    self._table(f"optim/{key}/{name}", tuple(value.shape), value.dtype)
        self._scaler_state = common.get("loss_scaler")
        return stage, per_group_scalars(steps, len(groups), path), groups

    # ------------------------------------------------------------ ZeRO files
    def _read_zero(
        self, optim: list[tuple[int, str]], zero3_models: list[tuple[int, str]]
    ) -> tuple[int, dict[str, dict[str, Any]], list[dict[str, Any]]]:
        world = len(optim)
        ranks = [r for r, _ in optim]
        if ranks != list(range(world)):
            missing = sorted(set(range(max(ranks) + 1)) - set(ranks))
            raise CheckpointError(
                f"{self.dir} lacks the optimizer files of ranks {missing} "
                f"(*zero_pp_rank_<r>_mp_rank_00_optim_states.pt): copy the whole tag directory"
            )
        osds = []
        for _, name in optim:
            path = self.dir / name
            osds.append((path, require_key(load_file(path), "optimizer_state_dict", path)))
        first_path, first = osds[0]
        if "zero_stage" in first:
            stage = stage_of(first["zero_stage"])
        elif "single_partition_of_fp32_groups" in first:
            stage = 0  # DeepSpeed's BF16_Optimizer (bf16 without ZeRO): the stage-1 layout
        else:
            require_key(first, "zero_stage", first_path)
            stage = 0
        count = first.get("partition_count")
        counts = count if isinstance(count, list) else [count]
        # Expert param groups (MoE) are partitioned over world / ep_size ranks.
        has_base = "base_optimizer_state" in first or "optimizer_state_dict" in first
        ep = [_ep_size(g, first_path) for g in base_state(first, first_path)[1]] if has_base else []
        want = [world // e for e in ep] if len(ep) == len(counts) else [world] * len(counts)
        if any(c is not None and int(c) != n for c, n in zip(counts, want)):
            raise CheckpointError(
                f"{first_path} says the states were partitioned over {counts} ranks but "
                f"{self.dir} holds {world} optimizer files: files are missing or come from "
                "different runs"
            )
        shapes = require_key(self.model_states, "param_shapes", self._model_file)
        if self._experts and stage == 3:
            raise CheckpointError(
                f"{self.dir}: a mixture-of-experts checkpoint at ZeRO stage 3; slipstream "
                "cannot read it. Save it from DeepSpeed at ZeRO stage 1 or 2"
            )
        if stage == 3:
            if len(zero3_models) != world:
                raise CheckpointError(
                    f"{self.dir} has {len(zero3_models)} zero_pp_rank_*_model_states.pt files "
                    f"for {world} optimizer files: copy the whole tag directory"
                )
            base, groups = self._layout_zero3(osds, shapes, world)
            self._read_zero3_frozen(zero3_models, world)
        else:
            moe = ExpertLayout(
                world, bool(self.ds_config.get(DATA_BEFORE_EXPERT)), self._layer_experts
            )
            base, groups = self._layout_zero12(osds, shapes, ep, moe)
        scalars = self._optimizer_states(osds, base, groups)
        return stage, scalars, groups

    def _layout_zero12(
        self,
        osds: list[tuple[Path, dict[str, Any]]],
        shapes: list[dict[str, Any]],
        ep: list[int],
        moe: ExpertLayout,
    ) -> tuple[list[Any], list[dict[str, Any]]]:
        """Each group's flat is partitioned over the data-parallel ranks, or, for an expert
        group of ``ep_size`` E, each expert-parallel rank's flat (its local experts) over its
        ``world / E`` expert-data-parallel ranks."""
        path0, osd0 = osds[0]
        partitions = [require_key(o, "single_partition_of_fp32_groups", p) for p, o in osds]
        paddings = [require_key(o, "group_paddings", p) for p, o in osds]
        align = osd0.get("param_alignment_paddings")
        if len(shapes) != len(partitions[0]):
            raise CheckpointError(
                f"{self._model_file} lists {len(shapes)} param groups in 'param_shapes' but "
                f"{path0} holds {len(partitions[0])} fp32 partitions"
            )
        sizes = [int(partitions[0][g].numel()) + int(paddings[0][g]) for g in range(len(shapes))]
        bases = [sum(sizes[:g]) for g in range(len(shapes))]
        world, expert_group = moe.world, [bool(g.get("moe")) for g in base_state(osd0, path0)[1]]
        for g, group in enumerate(shapes):
            e_size = ep[g] if g < len(ep) else 1
            for e in range(e_size):
                offset = 0
                for j, (name, shape) in enumerate(group.items()):
                    numel = math.prod(shape)
                    frags, done = [], 0
                    while done < numel:
                        idx = offset + done
                        part, local = divmod(idx, sizes[g])
                        n = min(numel - done, sizes[g] - local)
                        frags.append(Fragment(moe.rank(e_size, e, part), bases[g] + local, done, n))
                        done += n
                    if g < len(expert_group) and expert_group[g]:
                        name = moe.global_name(name, e_size, e, self._model_file)
                    self._add_trainable(name, tuple(shape), frags)
                    offset += numel + (int(align[g][j]) if align else 0)
            if offset > sizes[g] * (world // e_size):
                raise CheckpointError(
                    f"param group {g} of {self._model_file} needs {offset} elements but the "
                    f"{world // e_size} partitions in {self.dir} hold {sizes[g] * world // e_size}"
                )
        for r, (path, _) in enumerate(osds):
            self._flats[(r, "fp32")] = Flat(bases, partitions[r], f"{path} fp32 partition")
        base = [base_state(o, p) for p, o in osds]
        for r, (path, _) in enumerate(osds):
            states = base[r][0]
            for key in state_keys(states):
                self._flats[(r, key)] = Flat(bases, [s[key] for s in states], f"{path} '{key}'")
        return base, base[0][1]

    def _layout_zero3(
        self, osds: list[tuple[Path, dict[str, Any]]], shapes: list[dict[str, Any]], world: int
    ) -> tuple[list[Any], list[dict[str, Any]]]:
        local = 0
        for group in shapes:
            for name, shape in group.items():
                numel = math.prod(shape)
                per_rank = math.ceil(numel / world)
                frags = [
                    Fragment(r, local, r * per_rank, min(per_rank, numel - r * per_rank))
                    for r in range(world)
                    if r * per_rank < numel
                ]
                self._add_trainable(name, tuple(shape), frags)
                local += per_rank
        base = [base_state(o, p) for p, o in osds]
        for r, (path, osd) in enumerate(osds):
            flat = require_key(osd, "fp32_flat_groups", path)
            bases = [sum(int(t.numel()) for t in flat[:g]) for g in range(len(flat))]
            if bases[-1] + int(flat[-1].numel()) < local:
                raise CheckpointError(
                    f"{path} holds {bases[-1] + int(flat[-1].numel())} fp32 elements, fewer "
                    f"than the {local} that 'param_shapes' of {self._model_file} needs"
                )
            self._flats[(r, "fp32")] = Flat(bases, flat, f"{path} fp32_flat_groups")
            states = base[r][0]
            for key in state_keys(states):
                self._flats[(r, key)] = Flat(bases, [s[key] for s in states], f"{path} '{key}'")
        return base, base[0][1]

    def _read_zero3_frozen(self, models: list[tuple[int, str]], world: int) -> None:
        shapes = self.model_states.get("frozen_param_shapes") or {}
        if not shapes:
            return
        per_rank = [
            require_key(load_file(self.dir / n), "frozen_param_fragments", self.dir / n)
            for _, n in models
        ]
        for name, shape in shapes.items():
            numel = math.prod(shape)
            parts = [per_rank[r][name].reshape(-1) for r in range(world)]
            full = torch.cat(parts)[:numel].reshape(tuple(shape))
            self._full[f"model/{name}"] = full
            self._table(f"model/{name}", tuple(shape), full.dtype)

    def _add_trainable(self, name: str, shape: tuple[int, ...], frags: list[Fragment]) -> None:
        self._frags[f"master/{name}"] = ("fp32", frags)
        self._table(f"master/{name}", shape, torch.float32)

    def _optimizer_states(
        self, osds: list[tuple[Path, dict[str, Any]]], base: list[Any], groups: list[Any]
    ) -> dict[str, dict[str, Any]]:
        states, _ = base[0]
        keys = state_keys(states)
        for name, (_, frags) in list(self._frags.items()):
            if name.startswith("master/"):
                param = name.removeprefix("master/")
                for key in keys:
                    self._frags[f"optim/{key}/{param}"] = (key, frags)
                    self._table(f"optim/{key}/{param}", self.tensors[name]["shape"], torch.float32)
        return per_group_scalars(states, len(groups), osds[0][0])

    # ------------------------------------------------------------ stage 0
    def _read_stage0(self) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
        """Without ZeRO the model-states file's ``optimizer`` holds the torch optimizer's
        state dict (fp32), or DeepSpeed's FP16_Optimizer wrapper of it (bf16/fp16: the inner
        state dict, the fp32 masters per parameter or per flat group, the loss scale)."""
        sd = self.model_states.get("optimizer")
        if sd is None:
            return {}, []
        masters: list[torch.Tensor] | None = None
        if "optimizer_state_dict" in sd:  # FP16_Optimizer / FP16_UnfusedOptimizer
            self._scaler_state = sd
            masters = stage0_masters(sd, self._model_file)
            sd = sd["optimizer_state_dict"]
        if "state" not in sd or "param_groups" not in sd:
            raise CheckpointError(
                f"{self._model_file} key 'optimizer' holds a {sorted(sd)[:6]} state dict, "
                "neither a torch optimizer's nor DeepSpeed's FP16_Optimizer's; load with "
                "load_optimizer_states=False to take the weights only"
            )
        module = self.model_states.get("module") or {}
        skip = set(self.model_states.get("buffer_names") or [])
        skip |= set(self.model_states.get("shared_params") or {})
        names = [n for n in module if n not in skip]
        if self._experts:  # MoE: each expert-parallel rank's optimizer is in its expp_rank file
            sd, names = stage0_expert_states(self.dir, masters is None, names, self._experts)
            module = {**module, **self._experts}
        ids = [i for g in sd["param_groups"] for i in g["params"]]
        if len(ids) != len(names):
            raise CheckpointError(
                f"{self._model_file} key 'optimizer' holds {len(ids)} parameters but 'module' "
                f"{len(names)}: frozen parameters without ZeRO cannot be matched to their "
                "states; load with load_optimizer_states=False"
            )
        if masters is not None:
            flat = torch.cat([t.reshape(-1) for t in masters]) if masters else torch.empty(0)
            offset = 0
            for name in names:
                n, shape = module[name].numel(), tuple(module[name].shape)
                self._full[f"master/{name}"] = flat[offset : offset + n].reshape(shape)
                self._table(f"master/{name}", shape, torch.float32)
                offset += n
        states = [sd["state"].get(i, {}) for i in ids]
        for name, state in zip(names, states):
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.numel() == module[name].numel() > 1:
                    self._full[f"optim/{key}/{name}"] = value
                    self._table(f"optim/{key}/{name}", tuple(module[name].shape), value.dtype)
        groups = [dict(g) for g in sd["param_groups"]]
        return per_group_scalars(states, len(groups), self._model_file), groups

    # ------------------------------------------------------------ module, manifest
    def _read_module(self, stage: int) -> None:
        module = require_key(self.model_states, "module", self._model_file)
        if module is None:
            raise CheckpointError(
                f"{self._model_file} key 'module' is None: a pipeline-parallel checkpoint "
                "(the weights are in layer_* files); open it with deepspeed_pipe.open_deepspeed"
            )
        buffers = set(self.model_states.get("buffer_names") or [])
        shared = set(self.model_states.get("shared_params") or {})
        for name, value in module.items():
            if name in shared or not isinstance(value, torch.Tensor):
                continue
            kind = "buffer" if name in buffers else "model"
            if stage == 3 and kind == "model":
                continue  # empty placeholders: the values are the fp32 partitions
            self._full[f"{kind}/{name}"] = value
            self._table(f"{kind}/{name}", tuple(value.shape), value.dtype)
        for name, value in self._experts.items():
            kind = "buffer" if name in buffers else "model"
            self._full[f"{kind}/{name}"] = value
            self._table(f"{kind}/{name}", tuple(value.shape), value.dtype)
        for name in [n for n in self.tensors if n.startswith("master/")]:
            model = "model/" + name.removeprefix("master/")
            if model not in self.tensors:  # stage 3: the training-dtype value is the master's
                self._frags[model] = self._frags[name]
                self._table(model, self.tensors[name]["shape"], self.train_dtype)

    def _manifest(
        self,
        stage: int,
        optim: list[tuple[int, str]],
        scalars: dict[str, dict[str, Any]],
        groups: list[dict[str, Any]],
    ) -> dict[str, Any]:
        ms, path = self.model_states, self._model_file
        steps = int(require_key(ms, "global_steps", path))
        gas = int(self.ds_config.get("gradient_accumulation_steps") or 1)
        hparams = [
            {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"}
            for g in groups
        ]
        for g in hparams:
            g.pop("step", None)  # DeepSpeed's FusedAdam group counter, not torch's
        return {
            "source": "deepspeed",
            "ds_version": ms.get("ds_version"),
            "world_size": len(optim) or int(ms.get("dp_world_size") or 1),
            "dp_world_size": int(ms.get("dp_world_size") or 1),
            "zero_stage": stage,
            "global_steps": steps,
            "global_samples": int(ms.get("global_samples") or 0),
            "micro_steps": steps * gas,
            "skipped_steps": int(ms.get("skipped_steps") or 0),
            "loss_scaler": self._loss_scaler(optim),
            "param_groups": hparams,
            "optim_keys": sorted({t.split("/")[1] for t in self.tensors if t.startswith("optim/")}),
            "optim_scalars": scalars,
            "rank_state": False,
        }

    def _loss_scaler(self, optim: list[tuple[int, str]]) -> dict[str, Any] | None:
        scaler = self._scaler_state
        if scaler is None and optim:
            scaler = load_file(self.dir / optim[0][1])["optimizer_state_dict"].get("loss_scaler")
        state = vars(scaler) if isinstance(scaler, StandIn) else scaler
        if not isinstance(state, dict) or "cur_scale" not in state:
            return None
        return {
            "scale": float(state["cur_scale"]),
            "cur_hysteresis": int(state.get("cur_hysteresis", 1)),
            "iteration": int(state.get("cur_iter", 0)),
            "last_overflow_iter": int(state.get("last_overflow_iter", -1)),
        }

    # ------------------------------------------------------------ CheckpointReader's interface
    def _table(self, tensor: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.tensors[tensor] = {"shape": list(shape), "dtype": dtype_name(dtype)}

    def verify_share(self, rank: int, world: int) -> None:
        """Every file was opened (and its pickle read) in the constructor."""

    def trust_all(self) -> None:
        """Nothing to skip: DeepSpeed writes no checksums."""

    def load_object(self, name: str) -> Any:
        """``extra.pt``'s content (the lr scheduler and client state), in DeepSpeed's terms."""
        if name != "extra.pt":
            raise CheckpointError(f"a DeepSpeed checkpoint has no {name}")
        ms = self.model_states
        return {
            "lr_scheduler": ms.get("lr_scheduler"),
            "client_state": {k: v for k, v in ms.items() if k not in DS_STATE_KEYS},
        }

    def _read_into(self, tensor: str, start: int, stop: int, out: torch.Tensor) -> None:
        if tensor in self._full:
            out.copy_(self._full[tensor].reshape(-1)[start:stop])
            return
        kind, frags = self._frags[tensor]
        for f in frags:
            lo, hi = max(start, f.start), min(stop, f.start + f.numel)
            if lo < hi:
                part = self._flats[(f.rank, kind)].read(f.local + lo - f.start, hi - lo)
                out[lo - start : hi - start].copy_(part)

    def close(self) -> None:
        self._full.clear()
        self._flats.clear()


# The per-element states of the optimizer families a DeepSpeed run may hold.
_FAMILY_STATES = {
    "adam": {"exp_avg", "exp_avg_sq"},
    "lion": {"exp_avg"},
    "sgd": {"momentum_buffer"},
}


def check_optimizer(reader: DeepSpeedReader, opt: Any) -> None:
    """The engine's optimizer keeps the states the DeepSpeed run saved, or an error naming
    both (a different optimizer would start from states it cannot use)."""
    inner = type(getattr(opt, "optimizer", opt)).__name__
    family = next((f for f in _FAMILY_STATES if f in inner.lower()), None)
    saved = set(reader.manifest["optim_keys"])
    if family is None or not saved or saved == _FAMILY_STATES[family]:
        return
    ds_type = (reader.ds_config.get("optimizer") or {}).get("type", "a client optimizer")
    raise CheckpointError(
        f"{reader.dir} holds the states {sorted(saved)} of DeepSpeed's optimizer ({ds_type}), "
        f"but this engine's optimizer is {inner}, which keeps {sorted(_FAMILY_STATES[family])}: "
        "configure the optimizer the DeepSpeed run used, or pass load_optimizer_states=False "
        "to load the weights and counters only"
    )


DATA_BEFORE_EXPERT = "use_data_before_expert_parallelism"
"""DeepSpeed's config key that puts the expert-data-parallel ranks side by side."""


def _ep_size(group: dict[str, Any], path: Path) -> int:
    """The expert-parallel size of a param group (1 unless DeepSpeed marked it ``moe``)."""
    if not group.get("moe"):
        return 1
    name = str(group.get("name", ""))
    if not re.fullmatch(r"ep_size_\d+", name):
        raise CheckpointError(
            f"{path}: an expert param group named {name!r}, not DeepSpeed's 'ep_size_<n>'"
        )
    return int(name.removeprefix("ep_size_"))
