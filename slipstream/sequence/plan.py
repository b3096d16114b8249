"""Applying sequence parallelism to a model: ``parallelize_sequence_(model, sp_group)``.

Three routes, all from outside the model. A model with a ``sp_plan(sp_group)`` method returns
an :class:`SPPlan` (module name -> the sequence-parallel module replacing it; slipstream's
GPT: ``slipstream.models.gpt_plans``), which is applied in place. A module of any model can
instead take the group itself through ``set_sequence_parallel_group(group)``
(:class:`~slipstream.sequence.DistributedAttention`, DeepSpeed's way). A Hugging Face model
whose attention goes through transformers' attention registry gets Ulysses attention registered
for it (:func:`~slipstream.sequence.hf.install_hf_ulysses_`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from slipstream.distributed import comm
from slipstream.sequence.hf import install_hf_ulysses_, is_hf_attention_model
from slipstream.sequence.modules import SequenceParallelAttention
from slipstream.sequence.ring_hf import install_hf_ring_

__all__ = ["SPPlan", "parallelize_sequence_"]


@dataclass
class SPPlan:
    """What a model changes to run sequence-parallel.

    ``replace``: submodule name -> the module that takes its place (built with the group, e.g.
    a :class:`~slipstream.sequence.SequenceParallelAttention` for a local attention core).
    """

    replace: dict[str, nn.Module] = field(default_factory=dict)

    def apply_(self, model: nn.Module) -> None:
        """Swap the modules in place (parameters and their names are untouched)."""
        for name, new in self.replace.items():
            parent_name, _, leaf = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            if not hasattr(parent, leaf):
                raise ValueError(
                    f"sequence-parallel plan of {type(model).__name__} names {name!r}, which "
                    "is not a submodule: fix the model's sp_plan()"
                )
            setattr(parent, leaf, new)


def _check_ring_plan(owner: nn.Module, plan: SPPlan, ring_groups: RingGroups | None) -> None:
    """A plan's attention agrees with the config's ``sequence_parallel_mode``."""
    methods = {m.method for m in plan.replace.values() if isinstance(m, SequenceParallelAttention)}
    name = type(owner).__name__
    if ring_groups is None and "ring" in methods:
        raise ValueError(
            f"{name} uses ring attention (sequence_parallel='ring') but the config's "
            'sequence_parallel_mode is \'ulysses\': set "sequence_parallel_mode": "ring" '
            "(the data loader then cuts batches in the zig-zag layout ring attention needs)"
        )
    if ring_groups is not None and methods and methods != {"ring"}:
        raise ValueError(
            f"sequence_parallel_mode 'ring' but {name} was built with sequence-parallel "
            f"attention {sorted(methods)}: build it with sequence_parallel='ring' (for the "
            "reference GPT: GPTConfig(sequence_parallel='ring'))"
        )
    if ring_groups is not None and comm.get_world_size(ring_groups[0]) > 1:
        raise ValueError(
            f"{name}: Ulysses x ring (sequence_parallel_ring_size < sequence_parallel_size) "
            "is wired for Hugging Face models only; for this model set "
            "sequence_parallel_ring_size to sequence_parallel_size (pure ring)"
        )


RingGroups = tuple[comm.Group, comm.Group]


def parallelize_sequence_(
    model: nn.Module,
    sp_group: comm.Group,
    ring_groups: RingGroups | None = None,
    local_group: comm.Group | None = None,
    tp_size: int = 1,
) -> nn.Module:
    """Make ``model`` run on sequence segments sharded over ``sp_group``, in place.

    Every submodule with an ``sp_plan(sp_group)`` method has its plan applied; every
    submodule with ``set_sequence_parallel_group(group)`` is bound to the group; a Hugging
    Face model using transformers' attention registry, where neither applies, gets Ulysses
    attention, global positions and the sharded loss installed
    (``slipstream.initialize`` calls this when ``sequence_parallel_size > 1``).
    ``ring_groups``: ``(ulysses, ring)`` groups for ring attention (``sequence_parallel_mode:
    "ring"``; ``slipstream.distributed.mesh.sp_ring_groups``): a Hugging Face model gets ring
    (or Ulysses x ring) attention instead of Ulysses, a plan must use ring attention.
    ``local_group``: a group of this rank alone, with which a Hugging Face model under
    Ulysses attends within each document of packed rows
    (:func:`~slipstream.sequence.hf.install_hf_ulysses_`).
    ``tp_size``: the tensor-parallel degree the model was already split over
    (``parallelize_tp_``); a Hugging Face model's head counts are checked per TP rank.

    Raises:
        ValueError: no submodule takes part while the group has more than one rank (the model
            would silently attend within each shard only).
        ConfigError: raised by a model's plan (e.g. a GPT built without sequence-parallel
            attention).
    """
    bound = 0
    for owner in list(model.modules()):  # a snapshot: plans replace submodules
        sp_plan = getattr(owner, "sp_plan", None)
        if not callable(sp_plan):
            continue
        plan = sp_plan(sp_group)
        if not isinstance(plan, SPPlan):
            raise TypeError(
                f"{type(owner).__name__}.sp_plan() returned {type(plan).__name__}, not an "
                "SPPlan: return slipstream.sequence.SPPlan"
            )
        _check_ring_plan(owner, plan, ring_groups)
        plan.apply_(owner)
        bound += 1
    for module in model.modules():
        setter = getattr(module, "set_sequence_parallel_group", None)
        if callable(setter) and ring_groups is not None:
            raise ValueError(
                f"sequence_parallel_mode 'ring': {type(module).__name__} takes the sequence-"
                "parallel group itself (DeepSpeed's DistributedAttention runs Ulysses); use "
                "sequence_parallel_mode 'ulysses', or slipstream.sequence.ring_attention"
            )
        if callable(setter):
            setter(sp_group)
            bound += 1
    if bound == 0 and comm.get_world_size(sp_group) > 1 and is_hf_attention_model(model):
        if ring_groups is not None:
            install_hf_ring_(model, sp_group, *ring_groups, tp_size=tp_size)
        else:
            install_hf_ulysses_(model, sp_group, local_group, tp_size=tp_size)
        bound += 1
    if bound == 0 and comm.get_world_size(sp_group) > 1:
        raise ValueError(
            f"sequence_parallel_size={comm.get_world_size(sp_group)} but "
            f"{type(model).__name__} has no sequence-parallel attention: build the reference "
            "GPT with GPTConfig(sequence_parallel='ulysses' or 'lss'), or route your attention "
            "through slipstream.sequence.DistributedAttention (Hugging Face models using "
            "transformers' attention registry are handled automatically)"
        )
    return model
