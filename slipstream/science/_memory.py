"""Exact peak of live tensor memory over a region of code, on any device.

CPU PyTorch has no allocator statistics (``torch.cuda.max_memory_allocated`` has no CPU
twin) and the process RSS mixes in allocator caching and the Python heap. This tracker
counts what the attention kernels actually hold: a ``TorchDispatchMode`` sees every tensor an
operator returns; each new storage adds its bytes to a running total and a weakref
finalizer subtracts them when the storage dies. The high-water mark of that total is the
peak of tensor memory allocated inside the region (storages that existed before it, such as
inputs, are not counted). Autograd's backward ops run under the same mode, so a region
holding ``forward`` + ``backward`` includes saved activations and every gradient buffer.

Every operator goes through Python while the mode is active, so do not time code inside it.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["TensorMemoryTracker"]


class TensorMemoryTracker(TorchDispatchMode):
    """Context manager recording live and peak bytes of storages created inside it.

    Example::

        with TensorMemoryTracker() as mem:
            out = f(x)
            out.backward(grad)
        print(mem.peak_bytes)

    Attributes:
        live_bytes: bytes of tracked storages still alive.
        peak_bytes: largest ``live_bytes`` seen since entering.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._seen: weakref.WeakSet[torch.UntypedStorage] = weakref.WeakSet()

    def _release(self, nbytes: int) -> None:
        self.live_bytes -= nbytes

    def _mark_existing(self, tensors: list[Any]) -> None:
        # Storages an op receives and were not created here (inputs, parameters) are
        # remembered without counting, so an in-place op returning them adds nothing.
        for t in tensors:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage not in self._seen:
                    self._seen.add(storage)

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage in self._seen:
            return
        self._seen.add(storage)
        nbytes = storage.nbytes()
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(storage, self._release, nbytes)

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        self._mark_existing(tree_leaves((args, kwargs)))
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out
