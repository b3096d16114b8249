"""Per-(axis, op) communication counters: calls, message bytes, cross-node bytes and time.

Every collective of the comm layer is counted here (``comm_counters.record``) and timed from
issue to completion (``timeouts.on_complete``: a synchronous call when it returns, an
asynchronous one when it is waited on). ``log_summary`` / ``summary_table`` print them: the
``comms_logger`` report. On CPU (gloo) the times are the collectives' wall times; on an
accelerator whose calls return before they finish they are host-side times unless the
device is synchronized around each call (``timeouts.set_device_sync``, which the engine does
when ``comms_logger.enabled``, as DeepSpeed's comms logger does).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass

import torch.distributed as dist

from slipstream._logging import logger
from slipstream.distributed.groups import Group, axis_name, group_ranks
from slipstream.distributed.timeouts import Call, on_complete

__all__ = [
    "CommCounters",
    "OpStats",
    "comm_counters",
    "log_summary",
    "set_ranks_per_node",
    "summary_table",
]


@dataclass
class OpStats:
    """Calls and message bytes of one collective on one axis."""

    calls: int = 0
    bytes: int = 0
    cross_node_bytes: float = 0.0
    """This rank's share of the bytes crossing node boundaries (see ``_cross_node_bytes``)."""
    seconds: float = 0.0
    """Wall time from issue to completion (see ``timeouts.on_complete``), summed."""


class CommCounters:
    """Per-(axis, op) counters; ``verbose`` logs every call."""

    def __init__(self) -> None:
        self.stats: dict[tuple[str, str], OpStats] = defaultdict(OpStats)
        self.enabled = True
        self.verbose = False
        self.prof_ops: set[str] | None = None

    def record(self, op: str, group: Group, nbytes: int, label: str | None) -> None:
        if not self.enabled or (self.prof_ops is not None and op not in self.prof_ops):
            return
        axis = axis_name(group)
        entry = self.stats[(axis, op)]
        entry.calls += 1
        entry.bytes += nbytes
        if _TOPOLOGY.get("ranks_per_node"):
            entry.cross_node_bytes += _cross_node_bytes(op, group, nbytes)
        if self.verbose:
            logger.info("comm %s axis=%s bytes=%d label=%s", op, axis, nbytes, label or "-")

    def bytes_by_axis(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for (axis, _), entry in self.stats.items():
            out[axis] += entry.bytes
        return dict(out)

    def cross_node_bytes(self) -> float:
        """This rank's share of cross-node bytes; summed over all ranks and divided by the
        number of nodes it is the traffic over each node's boundary."""
        return sum(e.cross_node_bytes for e in self.stats.values())

    def reset(self) -> None:
        self.stats.clear()

    def completed(self, call: Call, seconds: float) -> None:
        """A counted collective finished after ``seconds`` (a ``timeouts`` listener)."""
        entry = self.stats.get((axis_name(call.group), call.op))
        if entry is not None:
            entry.seconds += seconds


comm_counters = CommCounters()
on_complete(comm_counters.completed)


_TOPOLOGY: dict[str, int] = {}


def set_ranks_per_node(ranks_per_node: int) -> None:
    """Declare how many consecutive global ranks share a node (enables cross-node counts)."""
    _TOPOLOGY["ranks_per_node"] = ranks_per_node


def _cross_node_bytes(op: str, group: Group, nbytes: int) -> float:
    """Bytes of this collective that cross node boundaries, as this rank's share.

    Model: all-gather, reduce-scatter and broadcast are rings over the group's ranks in rank
    order (node-major), so each spanned node's boundary carries (k-1)/k of the full message;
    all-reduce is a reduce-scatter plus an all-gather; an all-to-all sends 1/k of this rank's
    input to each peer, and the part addressed to other nodes crosses. A ring's per-node
    volume is split evenly over the node's ranks in the group, so summing every rank's share
    and dividing by the node count gives the volume per node boundary.
    """
    if not dist.is_initialized():
        return 0.0
    per_node = _TOPOLOGY["ranks_per_node"]
    ranks = group_ranks(group)
    k = len(ranks)
    me = dist.get_rank()
    nodes = {r // per_node for r in ranks}
    if k == 1 or len(nodes) == 1:
        return 0.0
    mates = sum(r // per_node == me // per_node for r in ranks)
    if op == "all_to_all":
        return nbytes / k * sum(r // per_node != me // per_node for r in ranks)
    ring = (k - 1) / k * nbytes / mates
    if op == "all_reduce":
        return 2 * ring
    if op in ("all_gather", "reduce_scatter", "broadcast"):
        return ring
    return 0.0


def log_summary(reset: bool = False) -> dict[str, dict[str, dict[str, int]]]:
    """Log (rank 0) and return the per-axis, per-op call and byte counts since start/reset."""
    table: dict[str, dict[str, dict[str, int]]] = defaultdict(dict)
    for (axis, op), entry in sorted(comm_counters.stats.items()):
        table[axis][op] = {"calls": entry.calls, "bytes": entry.bytes}
    if not dist.is_initialized() or dist.get_rank() == 0:
        text = "communication summary (this rank):\n" + summary_table()
        logger.log(logging.INFO, text)
    if reset:
        comm_counters.reset()
    return dict(table)


def summary_table(step_seconds: float | None = None) -> str:
    """The comms_logger table: per (axis, op) calls, total MB, time, achieved bandwidth (message
    bytes over time, GB/s) and, given the training time ``step_seconds``, the share of it."""
    head = f"{'axis':<14}{'op':<22}{'calls':>8}{'MB':>12}{'time ms':>11}{'GB/s':>9}"
    lines = [head + (f"{'share':>8}" if step_seconds else "")]
    for (axis, op), e in sorted(comm_counters.stats.items()):
        rate = f"{e.bytes / e.seconds / 1e9:>9.3f}" if e.seconds > 0 and e.bytes else f"{'-':>9}"
        row = (
            f"{axis:<14}{op:<22}{e.calls:>8}{e.bytes / 2**20:>12.2f}{e.seconds * 1e3:>11.1f}{rate}"
        )
        if step_seconds:
            row += f"{100 * e.seconds / step_seconds:>7.1f}%"
        lines.append(row)
    return "\n".join(lines)
