"""Search the layouts of a model on ``world`` devices and rank them by predicted step time.

The constraints (Dash et al. 2023, sec. 4; specs/parallelism.md sec. 4.5):

- TP divides the attention heads and stays inside a node (``tp <= devices per node``), where
  its per-layer collectives run on the fast links;
- PP times the virtual stages divides the layers;
- ``tp * pp * dp = world`` and the global batch is a multiple of ``micro_batch * dp``;
- a pipeline runs with ZeRO stage 0 or 1 only (later stages would reduce and gather the
  gradients of every micro-batch, which DeepSpeed refuses);
- the most loaded device fits the profile's usable memory.

Every field the caller fixes is kept; the others are enumerated. At a fixed global batch the
shortest step is the highest throughput; ties go to the smaller memory.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from slipstream.planner.hardware import Hardware
from slipstream.planner.layout import Layout, Recompute
from slipstream.planner.model import ModelSpec
from slipstream.planner.predict import Prediction, predict

__all__ = ["SearchResult", "search", "valid_tp_sizes"]

_MICRO_BATCHES = (1, 2, 4, 8, 16, 32)
_MAX_VIRTUAL = 8
_RECOMPUTE: tuple[Recompute, ...] = ("none", "selective", "full")


@dataclass(frozen=True)
class SearchResult:
    """Ranked layouts that fit, and how many were enumerated and rejected."""

    ranked: list[Prediction]
    """Fitting layouts, fastest first."""
    enumerated: int
    """Layouts enumerated (after the divisibility rules)."""
    rejected_memory: int
    """Of those, layouts whose most loaded device does not fit."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def valid_tp_sizes(model: ModelSpec, hw: Hardware, world: int) -> list[int]:
    """TP sizes that divide the heads (and KV heads) and the world and fit in one node."""
    return [
        t
        for t in _divisors(world)
        if model.heads % t == 0 and model.kv % t == 0 and t <= hw.devices_per_node
    ]


def _options(
    fixed: dict[str, Any], key: str, choices: Sequence[Any], *, strict: bool = False
) -> Sequence[Any]:
    """``choices``, or the fixed value (only if it is one of them when ``strict``)."""
    if fixed.get(key) is None:
        return choices
    return [fixed[key]] if not strict or fixed[key] in choices else []


def _candidates(
    model: ModelSpec, hw: Hardware, world: int, batch: int, fixed: dict[str, Any]
) -> Iterator[Layout]:
    base = Layout(**{k: v for k, v in fixed.items() if k in _PASSTHROUGH and v is not None})
    for tp in _options(fixed, "tp", valid_tp_sizes(model, hw, world), strict=True):
        pps = [p for p in _divisors(world // tp) if model.layers % p == 0]
        for pp in _options(fixed, "pp", pps, strict=True):
            if world % (tp * pp):
                continue
            dp = world // (tp * pp)
            chunks = range(1, _MAX_VIRTUAL + 1) if pp > 1 else (1,)
            for v in _options(fixed, "virtual_stages", chunks):
                if model.layers % (pp * v) or (v > 1 and pp == 1):
                    continue
                for b in _options(fixed, "micro_batch", _MICRO_BATCHES):
                    if batch % (b * dp):
                        continue
                    yield from _variants(base, fixed, tp, pp, dp, v, b, batch)


def _variants(
    base: Layout, fixed: dict[str, Any], tp: int, pp: int, dp: int, v: int, b: int, batch: int
) -> Iterator[Layout]:
    stages = (0, 1) if pp > 1 else (0, 1, 2, 3)
    for zero in _options(fixed, "zero_stage", stages if dp > 1 else (0,)):
        for recompute in _options(fixed, "recompute", _RECOMPUTE):
            for sp in _options(fixed, "sequence_parallel", (False, True) if tp > 1 else (False,)):
                yield replace(
                    base, tp=tp, pp=pp, dp=dp, virtual_stages=v, micro_batch=b,
                    global_batch=batch, zero_stage=zero, recompute=recompute,
                    sequence_parallel=sp,
                )  # fmt: skip


# Layout fields the search never enumerates: taken from ``fixed`` as given.
_PASSTHROUGH = {
    "hpz_partition_size",
    "quantized_weights",
    "quantized_gradients",
    "gpipe",
    "offload_optimizer",
    "offload_param",
    "grad_bytes",
    "param_bytes",
    "overlap_comm",
}


def search(
    model: ModelSpec,
    hardware: Hardware,
    world: int,
    global_batch: int,
    fixed: dict[str, Any] | None = None,
    *,
    top: int | None = None,
) -> SearchResult:
    """Enumerate layouts of ``model`` on ``world`` devices, keep those that fit, rank them.

    Args:
        fixed: :class:`Layout` fields to hold (e.g. ``{"tp": 8, "recompute": "full"}``);
            None values are searched.
        top: keep only this many of the ranked layouts.
    Raises:
        ValueError: an unknown field in ``fixed``, a bad world or batch, or nothing
            enumerable (the message says which constraint emptied the space).
    """
    fixed = dict(fixed or {})
    unknown = sorted(set(fixed) - set(Layout.__dataclass_fields__))
    if unknown:
        raise ValueError(f"search: unknown layout fields {unknown}")
    if world < 1 or global_batch < 1:
        raise ValueError(f"search: world = {world} and global_batch = {global_batch} must be >= 1")
    fits: list[Prediction] = []
    enumerated = rejected = 0
    for layout in _candidates(model, hardware, world, global_batch, fixed):
        enumerated += 1
        try:
            prediction = predict(model, hardware, layout)
        except ValueError:
            continue  # a fixed field the enumerated ones cannot honour (e.g. hpZ vs dp)
        if prediction.fits:
            fits.append(prediction)
        else:
            rejected += 1
    if not enumerated:
        raise ValueError(
            f"no layout of {world} devices satisfies the constraints for {model.heads} heads, "
            f"{model.layers} layers, global batch {global_batch} and fixed {fixed}: TP must "
            f"divide the heads and be <= {hardware.devices_per_node} (one node), PP must "
            "divide the layers, and the batch must be a multiple of micro_batch * dp"
        )
    fits.sort(key=lambda p: (p.step_time_s, p.memory_per_rank_bytes))
    return SearchResult(fits[:top] if top else fits, enumerated, rejected)
