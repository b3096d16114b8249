"""Process groups as the comm layer names them: the mesh axis each belongs to and its ranks.

Kept apart from ``comm`` so the parts of the comm layer below it (timeouts, arrivals) can name
a group in an error without importing ``comm``.
"""

from __future__ import annotations

import os

import torch.distributed as dist

__all__ = [
    "Group",
    "axis_name",
    "get_local_rank",
    "group_ranks",
    "is_process_group",
    "register_axis",
    "world_group",
]

Group = dist.ProcessGroup | None
"""A process group; None is the default (world) group, as in ``torch.distributed``."""

_AXES: dict[int, str] = {}
_GROUP_RANKS: dict[int, list[int]] = {}


def is_process_group(obj: object) -> bool:
    """Whether ``obj`` is a ``torch.distributed`` process group."""
    return isinstance(obj, dist.ProcessGroup)


def world_group() -> dist.ProcessGroup:
    """The default (world) group as an object, for APIs whose callers test ``is not None``
    (DeepSpeed's ``mpu`` getters return a group, never None). Needs an initialized world."""
    group = dist.GroupMember.WORLD
    if group is None:
        raise RuntimeError("torch.distributed is not initialized: there is no world group")
    return group


def register_axis(group: Group, name: str) -> None:
    """Name the mesh axis a process group belongs to (done by the mesh builder)."""
    _AXES[id(group)] = name


def axis_name(group: Group) -> str:
    """Axis label of ``group``: its registered name, or 'world' for the default group."""
    if group is None or group is dist.GroupMember.WORLD:
        return _AXES.get(id(dist.GroupMember.WORLD), "world")
    return _AXES.get(id(group), "unnamed")


def group_ranks(group: Group) -> list[int]:
    """The global ranks of ``group`` in group-rank order (cached: asked on every collective)."""
    key = id(group)
    if key not in _GROUP_RANKS:
        g = dist.GroupMember.WORLD if group is None else group
        _GROUP_RANKS[key] = dist.get_process_group_ranks(g)
    return _GROUP_RANKS[key]


def get_local_rank() -> int:
    """This process's rank on its node, as the launcher set it (0 without one)."""
    return int(os.environ.get("LOCAL_RANK", "0"))
