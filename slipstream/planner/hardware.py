"""Hardware profiles: what one accelerator computes and how fast its links move bytes.

A profile is a JSON file (``slipstream/planner/profiles/<name>.json``; ``local`` is written by
``slipstream plan --calibrate`` into the user's cache). Each number carries its source in the
file's ``sources`` block: vendor data sheets for peaks, and marked estimates for the achievable
fractions, which the data sheets do not give. A profile names its ``accelerator`` instead of
giving ``peak_tflops``: the peak then comes from the one data-sheet table,
``slipstream.accelerator.peaks``, which the FLOPs profiler's MFU reads too.

The model of a link is the alpha-beta one (Hockney 1994): moving ``n`` bytes costs
``latency + n / (bandwidth * efficiency)``. Intra-node links come in tiers by group size
(Frontier: the two GCDs of one MI250X share 200 GB/s, a ring over more GCDs runs at the
50 GB/s of a single Infinity Fabric link); inter-node traffic shares the node's NICs.
"""

from __future__ import annotations

import bisect
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from slipstream.accelerator.peaks import data_sheet

__all__ = [
    "BUILTIN_PROFILES",
    "Hardware",
    "LinkTier",
    "load_hardware",
    "local_profile_path",
]

_PROFILE_DIR = Path(__file__).with_name("profiles")
BUILTIN_PROFILES = ("frontier-mi250x", "dgx-a100-80gb", "dgx-h100")


@dataclass(frozen=True)
class LinkTier:
    """Intra-node links for groups of up to ``max_group`` devices."""

    max_group: int
    """Largest group (devices of one node) this tier serves."""
    bandwidth_gbps: float
    """Peak bandwidth per device, per direction, in GB/s (1e9 bytes)."""


@dataclass(frozen=True)
class Hardware:
    """One accelerator and its node. Loaded with :func:`load_hardware`."""

    name: str
    """Profile name (``frontier-mi250x``, ``dgx-a100-80gb``, ``dgx-h100``, ``local``)."""
    peak_tflops: float
    """Dense peak of the training dtype (bf16/fp16) per device, in 1e12 FLOP/s."""
    gemm_tflops: tuple[tuple[float, float], ...]
    """Achievable GEMM rate by GEMM size: ``(GFLOP of one GEMM, TFLOP/s)`` points, sorted;
    rates between points are interpolated in log(size), outside clamped."""
    memory_bytes: int
    """Device memory per device."""
    memory_usable_fraction: float
    """Part of ``memory_bytes`` a training process can fill (context, allocator slack)."""
    memory_bandwidth_gbps: float
    """Device memory (HBM) bandwidth in GB/s."""
    memory_efficiency: float
    """Fraction of ``memory_bandwidth_gbps`` that elementwise kernels reach."""
    devices_per_node: int
    """Accelerators per node (Frontier: 8 GCDs)."""
    intra_node: tuple[LinkTier, ...]
    """Intra-node tiers, smallest group first."""
    intra_node_latency_s: float
    """Per-message latency inside a node."""
    intra_node_efficiency: float
    """Fraction of intra-node peak bandwidth that collectives reach (bus bandwidth)."""
    node_bandwidth_gbps: float
    """Inter-node injection bandwidth per node, per direction (all NICs), GB/s."""
    inter_node_latency_s: float
    """Per-message latency between nodes."""
    inter_node_efficiency: float
    """Fraction of ``node_bandwidth_gbps`` that collectives reach."""
    host_bandwidth_gbps: float
    """Host <-> device bandwidth per device (offload), GB/s."""
    attention_efficiency: float = 1.0
    """The attention core's rate (``Q K^T``, softmax, ``P V``, forward and backward through
    SDPA, causal, FLOPs counted as if unmasked) as a fraction of a GEMM's of the same FLOPs.
    1 for the published GPU profiles (not modelled separately there); measured by
    ``slipstream plan --calibrate``: on a CPU the fused attention runs at well under the
    GEMM rate."""
    reduce_scatter_scratch: bool = False
    """Whether slipstream's reduce-scatter on this machine's backend stages a copy of its
    input: on gloo it is an all-to-all into a scratch buffer of the input's size plus a
    local sum, and the buffer is kept for reuse, so ZeRO stages 2 and 3 hold up to two
    gradient buckets more. False for NCCL/RCCL (the published profiles); set by
    ``slipstream plan --calibrate`` on a CPU."""
    sources: dict[str, str] = field(default_factory=dict, compare=False)
    """Where each number comes from."""

    def gemm_rate(self, gflop: float) -> float:
        """Achievable FLOP/s for one GEMM of ``gflop`` GFLOP (log-linear interpolation)."""
        sizes = [p[0] for p in self.gemm_tflops]
        rates = [p[1] for p in self.gemm_tflops]
        if gflop <= sizes[0]:
            return rates[0] * 1e12
        if gflop >= sizes[-1]:
            return rates[-1] * 1e12
        i = bisect.bisect_right(sizes, gflop)
        x0, x1 = math.log(sizes[i - 1]), math.log(sizes[i])
        w = (math.log(gflop) - x0) / (x1 - x0)
        return (rates[i - 1] + w * (rates[i] - rates[i - 1])) * 1e12

    def intra_bandwidth(self, group: int) -> float:
        """Achievable bytes/s per device for a collective over ``group`` devices of one node."""
        for tier in self.intra_node:
            if group <= tier.max_group:
                return tier.bandwidth_gbps * 1e9 * self.intra_node_efficiency
        raise ValueError(
            f"a group of {group} devices does not fit in one node of {self.name} "
            f"({self.devices_per_node} devices)"
        )

    def inter_bandwidth(self, rings_per_node: int) -> float:
        """Achievable bytes/s of one of ``rings_per_node`` concurrent rings that all leave the
        node through its shared NICs."""
        share = max(1, min(rings_per_node, self.devices_per_node))
        return self.node_bandwidth_gbps * 1e9 * self.inter_node_efficiency / share

    @property
    def usable_memory(self) -> int:
        """Bytes a training process may plan to fill on one device."""
        return int(self.memory_bytes * self.memory_usable_fraction)

    def to_dict(self) -> dict[str, Any]:
        """The profile as its JSON file holds it."""
        return {
            "name": self.name,
            "peak_tflops": self.peak_tflops,
            "gemm_tflops": [list(p) for p in self.gemm_tflops],
            "memory_bytes": self.memory_bytes,
            "memory_usable_fraction": self.memory_usable_fraction,
            "memory_bandwidth_gbps": self.memory_bandwidth_gbps,
            "memory_efficiency": self.memory_efficiency,
            "devices_per_node": self.devices_per_node,
            "intra_node": [[t.max_group, t.bandwidth_gbps] for t in self.intra_node],
            "intra_node_latency_s": self.intra_node_latency_s,
            "intra_node_efficiency": self.intra_node_efficiency,
            "node_bandwidth_gbps": self.node_bandwidth_gbps,
            "inter_node_latency_s": self.inter_node_latency_s,
            "inter_node_efficiency": self.inter_node_efficiency,
            "host_bandwidth_gbps": self.host_bandwidth_gbps,
            "attention_efficiency": self.attention_efficiency,
            "reduce_scatter_scratch": self.reduce_scatter_scratch,
            "sources": dict(self.sources),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], origin: str = "profile") -> Hardware:
        """Parse a profile; a missing or unknown key is an error naming it and ``origin``."""
        data = _peak_from_data_sheet(data, origin)
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        optional = {"sources", "attention_efficiency", "reduce_scatter_scratch"}
        missing = sorted(known - set(data) - optional)
        if unknown or missing:
            raise ValueError(
                f"hardware {origin}: unknown keys {unknown}, missing keys {missing}; "
                f"a profile has exactly {sorted(known)}"
            )
        points = tuple(sorted((float(g), float(r)) for g, r in data["gemm_tflops"]))
        tiers = tuple(LinkTier(int(g), float(b)) for g, b in sorted(data["intra_node"]))
        if not points or not tiers:
            raise ValueError(f"hardware {origin}: gemm_tflops and intra_node must not be empty")
        if any(r <= 0 for _, r in points) or any(g <= 0 for g, _ in points):
            raise ValueError(f"hardware {origin}: gemm_tflops points must be positive: {points}")
        if not float(data.get("attention_efficiency", 1.0)) > 0:
            raise ValueError(
                f"hardware {origin}: attention_efficiency = {data['attention_efficiency']!r} "
                "must be positive (1 = the attention core runs at the GEMM rate)"
            )
        fields = {k: data[k] for k in known - {"gemm_tflops", "intra_node", "sources"} if k in data}
        fields["memory_bytes"] = int(fields["memory_bytes"])
        fields["devices_per_node"] = int(fields["devices_per_node"])
        return cls(
            gemm_tflops=points, intra_node=tiers, sources=dict(data.get("sources", {})), **fields
        )


def _peak_from_data_sheet(data: dict[str, Any], origin: str) -> dict[str, Any]:
    """``data`` with ``accelerator`` replaced by that accelerator's dense bf16 ``peak_tflops``
    (and its source); unchanged without ``accelerator``."""
    if "accelerator" not in data:
        return data
    data = dict(data)
    name = data.pop("accelerator")
    sheet = data_sheet(str(name))
    peak = None if sheet is None else sheet.peaks.get(torch.bfloat16)
    if sheet is None or peak is None:
        raise ValueError(
            f"hardware {origin}: accelerator {name!r} has no bf16 data sheet in "
            "slipstream.accelerator.peaks; give peak_tflops instead"
        )
    if "peak_tflops" in data and not math.isclose(float(data["peak_tflops"]), peak / 1e12):
        raise ValueError(
            f"hardware {origin}: peak_tflops = {data['peak_tflops']} but the {name} data sheet "
            f"says {peak / 1e12:g}; give one of accelerator and peak_tflops"
        )
    data["peak_tflops"] = peak / 1e12
    data["sources"] = {**data.get("sources", {}), "peak_tflops": sheet.source}
    return data


def local_profile_path() -> Path:
    """Where ``slipstream plan --calibrate`` writes the ``local`` profile
    (``$SLIPSTREAM_CACHE`` or ``~/.cache/slipstream``, file ``planner-local.json``)."""
    root = os.environ.get("SLIPSTREAM_CACHE") or Path.home() / ".cache" / "slipstream"
    return Path(root) / "planner-local.json"


def load_hardware(name_or_path: str | os.PathLike[str]) -> Hardware:
    """A built-in profile by name, ``local`` (the calibrated one), or a JSON file path.

    Raises:
        ValueError: unknown name, ``local`` before calibrating, or a malformed file.
    """
    text = str(name_or_path)
    if text in BUILTIN_PROFILES:
        path = _PROFILE_DIR / f"{text}.json"
    elif text == "local":
        path = local_profile_path()
        if not path.is_file():
            raise ValueError(
                f"no 'local' hardware profile at {path}: run `slipstream plan --calibrate` "
                "on this machine first"
            )
    elif text.endswith(".json") and Path(text).is_file():
        path = Path(text)
    else:
        raise ValueError(
            f"unknown hardware {text!r}: use one of {[*BUILTIN_PROFILES, 'local']} or the path "
            "of a profile JSON file"
        )
    return Hardware.from_dict(json.loads(path.read_text()), origin=str(path))
