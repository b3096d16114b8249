"""The expert-parallel plan: give every MoE layer its groups from the mesh, and reduce
gradients the way expert parallelism needs.

With ``ep_size`` > 1 a rank holds ``num_experts / ep_size`` experts; every rank of its
expert-parallel group sends it tokens, so the local backward already sums those ranks'
contributions to its experts' gradients. Summing further over the expert-data-parallel group
(the ranks holding the same experts) and dividing by the whole data-parallel size gives the
gradient of the global-batch mean loss, the same value dense parameters get from their
average over the data-parallel group (Rajbhandari et al., DeepSpeed-MoE, section 5.2: expert
parameters are data-parallel over ``dp / ep`` ranks).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from slipstream.distributed import comm
from slipstream.distributed.expert import ExpertGroups, expert_groups
from slipstream.distributed.mesh import DeviceMesh
from slipstream.distributed.placement import tp_shard
from slipstream.moe.experts import mark_expert_params
from slipstream.moe.layer import MoE
from slipstream.moe.tensor_parallel import TPTokenSplit, sum_expert_grads_over_tp_
from slipstream.moe.utils import is_moe_param, moe_layers

if TYPE_CHECKING:
    from slipstream.moe.autoep import AutoEPExperts
    from slipstream.moe.dropless import DroplessMoE

__all__ = [
    "ExpertPlacement",
    "agree_expert_groups",
    "clip_grad_norm_",
    "expert_parallel_",
    "reduce_gradients_",
    "routing_stats",
]


def expert_parallel_(
    model: nn.Module, mesh: DeviceMesh | None, data_before_expert: bool = False
) -> dict[str, ExpertGroups]:
    """Give each MoE layer of ``model`` its expert-parallel group from ``mesh``, in place.

    Returns the groups by expert group name (``"ep_size_<n>"``). A collective call the first
    time an ``ep_size`` is seen (every rank must make it, in the same order).

    Under tensor parallelism (a ``tp`` axis of ``mesh`` larger than 1) each ``MoE`` layer,
    and each ``DroplessMoE`` or AutoEP layer with ``ep_size`` > 1, also gets what
    ``slipstream.moe.tensor_parallel`` describes: TP-replicated experts compute a share of the
    tokens each (their gradients summed over the TP group), TP-split experts
    (``enable_expert_tensor_parallelism``) all of them.

    Raises:
        ValueError: an ``ep_size`` that does not divide the data-parallel size; experts
            split (or not) against an ``MoE`` layer's ``enable_expert_tensor_parallelism``,
            or split at all in a ``DroplessMoE`` or AutoEP layer.
    """
    layers = moe_layers(model)
    out: dict[str, ExpertGroups] = {}
    tp_group = mesh.get_group("tp") if mesh is not None and mesh["tp"].size() > 1 else None
    for layer in layers:
        # Again: replacing parameters (``to_empty`` after meta construction) drops the marks.
        mark_expert_params(layer.expert_module, layer.expert_group_name)
        if tp_group is not None:
            _tensor_parallel_(layer, tp_group)
        groups = expert_groups(mesh, layer.ep_size, data_before_expert)
        layer.set_ep_group(groups.ep_group)
        out[layer.expert_group_name] = groups
        if layer.ep_size > 1:
            place = ExpertPlacement(
                comm.get_rank(groups.ep_group),
                layer.ep_size,
                layer.num_experts // layer.ep_size,
                stacked=not isinstance(layer, MoE),
                edp_lead=comm.get_rank(groups.edp_group) == 0,
            )
            for p in layer.expert_module.parameters():
                p.expert_placement = place  # type: ignore[attr-defined]
    return out


def agree_expert_groups(model: nn.Module, mesh: DeviceMesh) -> None:
    """Make every ``ep_size``'s expert groups on every rank, in one order, before
    :func:`expert_parallel_` runs on the ranks whose layers need them.

    Pipeline stages hold different layers, so some ranks may have no MoE layer, or other
    ``ep_size`` s, than others; but a process group is made by every rank of the world, and a
    rank that skipped one would name every later group differently (the next group any rank
    makes, in this engine or the next, would hang). One object all-gather over the world.
    """
    mine = sorted({layer.ep_size for layer in moe_layers(model) if layer.ep_size > 1})
    for ep_size in sorted({s for sizes in comm.all_gather_object(mine) for s in sizes}):
        expert_groups(mesh, ep_size)


def _tensor_parallel_(layer: MoE | DroplessMoE | AutoEPExperts, tp_group: comm.Group) -> None:
    """How an MoE layer of a tensor-parallel model computes each token once per TP group
    (``slipstream.moe.tensor_parallel``). ``DroplessMoE`` and AutoEP layers keep whole
    experts on every TP rank: at ``ep_size`` 1 each TP rank computes every token, at
    ``ep_size`` > 1 each computes its share of the rows (``TPTokenSplit``)."""
    tp = comm.get_world_size(tp_group)
    split = [n for n, p in layer.expert_module.named_parameters() if tp_shard(p) is not None]
    if not isinstance(layer, MoE):
        if layer.ep_size == 1:
            return  # whole experts on every TP rank, each computing every token (as before)
        if split:
            raise ValueError(
                f"{type(layer).__name__} expert parameters {split[:2]} are split over the "
                f"tensor-parallel group (autotp_size={tp}), but with ep_size={layer.ep_size} "
                "this layer keeps whole experts on every TP rank: leave its experts out of "
                "the model's TP plan"
            )
        layer.exchange = TPTokenSplit(tp_group)
        sum_expert_grads_over_tp_(layer.expert_module, tp_group)
        return
    if layer.enable_expert_tensor_parallelism:
        if not split:
            raise ValueError(
                "MoE enable_expert_tensor_parallelism=True but no expert parameter is split "
                f"over the tensor-parallel group (autotp_size={tp}): the model's TP plan "
                "(its tp_plan method) must give each expert's linear layers the 'colwise' and "
                "'rowwise' styles, or leave the model to the automatic plan"
            )
        # The split experts' own collectives handle the TP group; each row goes through the
        # expert all-to-all once per TP group and is all-gathered over TP around the experts.
        layer.deepspeed_moe.expert_tp_group = tp_group
        return
    if split:
        raise ValueError(
            f"MoE expert parameters {split[:2]} are split over the tensor-parallel group but "
            "the layer has enable_expert_tensor_parallelism=False: set it to True, or leave "
            "the experts out of the model's TP plan"
        )
    layer.deepspeed_moe.exchange = TPTokenSplit(tp_group)
    sum_expert_grads_over_tp_(layer.expert_module, tp_group)


@dataclass(frozen=True)
class ExpertPlacement:
    """Where a rank's expert parameter sits among all experts (for checkpoints, which save
    every expert once under its global id).

    Attributes:
        ep_rank: this rank's index in its expert-parallel group.
        ep_size: ranks in the group.
        num_local: experts per rank; local expert ``i`` is global ``ep_rank * num_local + i``.
        stacked: the local experts are dim 0 of the tensor (grouped and AutoEP experts),
            else each expert is its own module, ``deepspeed_experts.<i>`` (DeepSpeed's layer).
        edp_lead: this rank is the first of the ranks holding the same experts (it writes
            what is not sharded, such as frozen experts).
    """

    ep_rank: int
    ep_size: int
    num_local: int
    stacked: bool
    edp_lead: bool = True

    def global_name(self, name: str) -> str:
        """``name`` with the local expert index made global (module-per-expert layout)."""
        if self.stacked:
            return name
        m = list(_EXPERT_INDEX.finditer(name))[-1]
        gid = self.ep_rank * self.num_local + int(m.group(1))
        return f"{name[: m.start(1)]}{gid}{name[m.end(1) :]}"

    def global_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (shape[0] * self.ep_size, *shape[1:]) if self.stacked else shape

    def offset(self, numel: int) -> int:
        """Where this rank's tensor starts in the global tensor (flat elements)."""
        return self.ep_rank * numel if self.stacked else 0


_EXPERT_INDEX = re.compile(r"deepspeed_experts\.(\d+)\.")


def reduce_gradients_(
    model: nn.Module, dp_group: comm.Group, groups: dict[str, ExpertGroups]
) -> None:
    """Average gradients for data parallelism with experts (for loops without the engine).

    Dense parameters: all-reduce mean over ``dp_group``. Expert parameters of group name
    ``n``: all-reduce sum over ``groups[n].edp_group``, divided by the data-parallel size.
    Communication: one all-reduce per parameter with a gradient.
    """
    dp_size = comm.get_world_size(dp_group)
    for p in model.parameters():
        if p.grad is None:
            continue
        g = groups[p.group_name] if is_moe_param(p) else None  # type: ignore[attr-defined]
        if g is not None and g.ep_size > 1:
            if comm.get_world_size(g.edp_group) > 1:
                comm.all_reduce(p.grad, group=g.edp_group, label="moe_expert_grads")
            p.grad.div_(dp_size)
        elif dp_size > 1:
            comm.all_reduce(p.grad, group=dp_group, label="moe_dense_grads")
            p.grad.div_(dp_size)


def clip_grad_norm_(
    model: nn.Module, max_norm: float, dp_group: comm.Group, groups: dict[str, ExpertGroups]
) -> float:
    """Clip reduced gradients to ``max_norm`` over the true global norm; return that norm.

    Dense gradients are equal on every rank and count once; each expert's gradient lives on
    the ranks of one expert-parallel coordinate, so the expert part is summed over the
    expert-parallel group.
    """
    dense = torch.zeros((), dtype=torch.float64)
    expert: dict[str, torch.Tensor] = {}
    for p in model.parameters():
        if p.grad is None:
            continue
        sq = p.grad.detach().double().pow(2).sum().cpu()
        if is_moe_param(p) and groups[p.group_name].ep_size > 1:  # type: ignore[attr-defined]
            name = p.group_name  # type: ignore[attr-defined]
            expert[name] = expert.get(name, torch.zeros((), dtype=torch.float64)) + sq
        else:
            dense += sq
    total = dense
    for name, sq in expert.items():
        ep_group = groups[name].ep_group
        if ep_group is not None and comm.get_world_size(ep_group) > 1:
            sq = sq.reshape(1).clone()
            comm.all_reduce(sq, group=ep_group, label="moe_grad_norm")
        total = total + sq.reshape(())
    norm = math.sqrt(float(total))
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(coef)
    return norm


def routing_stats(model: nn.Module) -> dict[str, float]:
    """The last forward's routing statistics of every MoE layer, flat, for a monitor:
    ``moe/<i>/dropped_fraction``, ``moe/<i>/imbalance`` and ``moe/<i>/expert<e>_tokens``."""
    out: dict[str, float] = {}
    for i, layer in enumerate(moe_layers(model)):
        stats = layer.stats
        if stats is None:
            continue
        out[f"moe/{i}/dropped_fraction"] = stats.dropped_fraction
        out[f"moe/{i}/imbalance"] = stats.imbalance
        for e, n in enumerate(stats.tokens_per_expert.tolist()):
            out[f"moe/{i}/expert{e}_tokens"] = float(n)
    return out
