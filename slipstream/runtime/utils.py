"""``deepspeed.runtime.utils``: the helpers training scripts import from it."""

from __future__ import annotations

import gc
import random
from collections.abc import Callable, Sequence
from typing import Any

import torch

from slipstream._logging import log_rank0
from slipstream.accelerator import get_accelerator
from slipstream.parallel.pipeline.instructions import call_to_str
from slipstream.runtime.partition_utils import (
    PartitionedTensor,
    partition_balanced,
    partition_uniform,
    prefix_sum_inc,
)

__all__ = ["move_to_device", "see_memory_usage", "set_random_seed"]
__all__ += ["partition_balanced", "partition_uniform"]  # DeepSpeed's pipeline cut rules
__all__ += ["PartitionedTensor", "call_to_str", "count_used_parameters_in_backward"]
__all__ += ["prefix_sum_inc"]

_GIB = 1024**3


def set_random_seed(seed: int) -> None:
    """Seed Python's ``random``, NumPy's global generator (when installed) and torch.

    As DeepSpeed's: NumPy takes ``seed mod 2**32`` and torch ``seed mod 2**63``, the widths
    each accepts, so any Python int works.
    """
    random.seed(seed)
    try:
        import numpy
    except ImportError:
        pass
    else:
        numpy.random.seed(seed % 2**32)
    torch.manual_seed(seed % 2**63)


def see_memory_usage(message: str, force: bool = False) -> None:
    """Log ``message`` and the memory counters on rank 0, then reset the peaks.

    As DeepSpeed's, it does nothing unless ``force`` is true. The line holds the accelerator's
    allocated and peak-allocated memory, its reserved (cached) and peak-reserved memory, and
    the host's used memory. DeepSpeed prints to stdout; slipstream logs (rank 0, INFO).
    """
    if not force:
        return
    gc.collect()  # freed-but-uncollected tensors would inflate the numbers
    acc = get_accelerator()
    used = acc.total_memory() - acc.available_memory() if acc.device_name() == "cpu" else None
    host = f" | CPU used {used / _GIB:.2f} GB" if used is not None else ""
    log_rank0(
        "%s | MA %.2f GB Max_MA %.2f GB CA %.2f GB Max_CA %.2f GB%s",
        message,
        acc.memory_allocated() / _GIB,
        acc.max_memory_allocated() / _GIB,
        acc.memory_reserved() / _GIB,
        acc.max_memory_reserved() / _GIB,
        host,
    )
    acc.reset_peak_memory_stats()


def move_to_device(
    item: Any, device: torch.device | str, criterion_func: Callable[[Any], bool] | None = None
) -> Any:
    """``item`` with its tensors on ``device``: a tensor, or lists, tuples and dicts of them
    (nested), rebuilt with moved tensors (DeepSpeed's ``runtime.utils.move_to_device``).

    An item for which ``criterion_func`` returns true is moved *in place* (its ``.data``
    replaced, so the object and references to it stay); any other tensor is moved with
    ``.to(device)``, as in DeepSpeed. Leaves that are not tensors are returned unchanged
    (DeepSpeed calls ``.to`` on them and fails).
    """
    if criterion_func is not None and criterion_func(item):
        item.data = item.to(device).data
        return item
    if isinstance(item, list):
        return [move_to_device(v, device, criterion_func) for v in item]
    if isinstance(item, tuple):
        return tuple(move_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    if isinstance(item, torch.Tensor):
        return item.to(device)
    return item


def count_used_parameters_in_backward(parameters: Sequence[torch.Tensor]) -> int:
    """How many of ``parameters`` the running backward pass will produce a gradient for.

    Call it from inside a backward hook (DeepSpeed's helper, for hooks that must know when
    the last gradient of a step arrived). Parameters that need no gradient, or whose
    gradient node this backward does not reach, are not counted; parameters sharing one
    node count once.

    Raises:
        RuntimeError: called outside a backward pass.
    """
    from torch.autograd.graph import _get_grad_fn_or_grad_acc

    if torch._C._current_graph_task_id() == -1:
        raise RuntimeError("count_used_parameters_in_backward must be called during backward")
    nodes: dict[int, Any] = {}
    for p in parameters:
        if not isinstance(p, torch.Tensor) or not p.requires_grad:
            continue
        # Hooks run with grad mode off; the accumulator lookup of a leaf needs it on.
        with torch.enable_grad():
            node = _get_grad_fn_or_grad_acc(p)
        if node is not None:
            nodes.setdefault(id(node), node)
    return sum(bool(torch._C._will_engine_execute_node(n)) for n in nodes.values())
