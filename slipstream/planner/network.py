"""Time of a collective over a group of devices: ring algorithms on an alpha-beta link model.

For a group of ``g`` devices and a tensor of ``S`` bytes (Thakur et al. 2005; Patarasuk &
Yuan 2009), a ring

    all-reduce           moves 2 (g-1)/g * S per device in 2 (g-1) steps,
    all-gather / reduce-scatter  (g-1)/g * S            in   (g-1) steps,
    point-to-point       S                              in 1 step.

A group whose members sit in one node uses the intra-node tier of its span. Otherwise the ring
leaves every node through the node's NICs, which are shared by the ``min(stride, devices per
node)`` rings of the same kind that run side by side (one per offset inside the stride), and
it runs at its slowest hop (an intra-node one when a node holds several members).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from slipstream.planner.hardware import Hardware

__all__ = ["CommGroup", "collective_time"]

Op = Literal["all_reduce", "all_gather", "reduce_scatter", "p2p"]


@dataclass(frozen=True)
class CommGroup:
    """``size`` devices whose global ranks are ``stride`` apart."""

    size: int
    stride: int = 1

    def span(self) -> int:
        """Consecutive devices from the first member to the last."""
        return (self.size - 1) * self.stride + 1

    def inside_node(self, hw: Hardware) -> bool:
        return self.span() <= hw.devices_per_node


def _bandwidth_latency(hw: Hardware, group: CommGroup) -> tuple[float, float]:
    """Bandwidth of the ring's slowest hop and the latency of its slowest link."""
    if group.inside_node(hw):
        return hw.intra_bandwidth(group.span()), hw.intra_node_latency_s
    inter = hw.inter_bandwidth(group.stride)
    if group.stride < hw.devices_per_node:
        # Several members per node: the ring also hops between them on intra-node links.
        inter = min(inter, hw.intra_bandwidth(hw.devices_per_node))
    return inter, hw.inter_node_latency_s


def collective_time(hw: Hardware, op: Op, nbytes: float, group: CommGroup) -> float:
    """Seconds for one ``op`` on ``nbytes`` (the full tensor) over ``group``; 0 for one device."""
    g = group.size
    if op != "p2p" and g == 1:
        return 0.0
    bandwidth, latency = _bandwidth_latency(hw, group)
    if op == "p2p":
        return nbytes / bandwidth + latency
    steps = 2 * (g - 1) if op == "all_reduce" else g - 1
    return steps * (nbytes / g / bandwidth + latency)
