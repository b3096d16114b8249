"""One accelerator class for CPU and CUDA, answering as DeepSpeed's ``CPU_Accelerator`` and
``CUDA_Accelerator`` do.

Deliberate differences (docs/compatibility.md): ``current_device()`` on CPU is an int (DeepSpeed
returns the ``LOCAL_RANK`` string when it is set); ``is_fp16_supported()`` on CPU is False
rather than None when oneDNN has no fp16; ``device_count()`` on CPU reads the NUMA topology from
sysfs (DeepSpeed runs ``numactl`` and says 1 when it is missing).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import torch

__all__ = ["TorchAccelerator", "host_rss_bytes"]


def host_rss_bytes() -> int:
    """Resident set size of this process (what DeepSpeed's CPU accelerator calls memory)."""
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:
        pass
    try:
        resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def _numa_node_count() -> int:
    """NUMA nodes that have cores; nodes with the same core list (fake NUMA) count once."""
    seen: list[str] = []
    for node in sorted(Path("/sys/devices/system/node").glob("node[0-9]*")):
        try:
            cores = (node / "cpulist").read_text().strip()
        except OSError:
            continue
        if cores and (not seen or seen[-1] != cores):
            seen.append(cores)
    return max(1, len(seen))


class TorchAccelerator:
    """DeepSpeed's accelerator interface over ``torch`` for one device type.

    Args:
        device_type: ``"cpu"`` or ``"cuda"``.
    """

    def __init__(self, device_type: str) -> None:
        if device_type not in ("cpu", "cuda"):
            raise ValueError(f"TorchAccelerator({device_type!r}): expected 'cpu' or 'cuda'")
        self._name = device_type
        self._cuda = device_type == "cuda"
        self._max_rss = 0 if self._cuda else host_rss_bytes()

    def __repr__(self) -> str:
        return f"TorchAccelerator({self._name!r})"

    # --- devices --------------------------------------------------------------------------

    def device_name(self, device_index: int | None = None) -> str:
        """``"cuda"``/``"cuda:i"``; always ``"cpu"`` on CPU."""
        if self._cuda and device_index is not None:
            return f"cuda:{device_index}"
        return self._name

    def current_device(self) -> int:
        """CUDA's current device; on CPU the ``LOCAL_RANK`` (0 outside a launcher)."""
        if self._cuda:
            return torch.cuda.current_device()
        return int(os.environ.get("LOCAL_RANK", "0"))

    def current_device_name(self) -> str:
        """``"cuda:<current>"`` or ``"cpu"``: a string ``torch.device`` accepts."""
        if self._cuda:
            return f"cuda:{torch.cuda.current_device()}"
        return "cpu"

    def device(self, device_index: int | None = None) -> Any:
        """CUDA's device context manager (``torch.cuda.device``); None on CPU."""
        return torch.cuda.device(device_index) if self._cuda else None

    def set_device(self, device_index: int) -> None:
        """Make ``device_index`` current (no-op on CPU)."""
        if self._cuda:
            torch.cuda.set_device(device_index)

    def device_count(self) -> int:
        """CUDA devices; on CPU ``LOCAL_SIZE`` if set, else the NUMA nodes with cores."""
        if self._cuda:
            return torch.cuda.device_count()
        local_size = int(os.environ.get("LOCAL_SIZE", "0"))
        return local_size if local_size > 0 else _numa_node_count()

    def is_available(self) -> bool:
        return torch.cuda.is_available() if self._cuda else True

    def synchronize(self, device_index: int | None = None) -> None:
        """Wait for the device's queued work (no-op on CPU)."""
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def is_synchronized_device(self) -> bool:
        """True on CPU: work is done when the call returns."""
        return not self._cuda

    def communication_backend_name(self) -> str:
        """``"nccl"`` on CUDA, ``"gloo"`` on CPU (DeepSpeed's choice without oneCCL)."""
        return "nccl" if self._cuda else "gloo"

    # --- dtypes ---------------------------------------------------------------------------

    def is_bf16_supported(self) -> bool:
        if self._cuda and torch.cuda.is_available():
            return bool(torch.cuda.is_bf16_supported())
        return True

    def is_fp16_supported(self) -> bool:
        """CUDA: compute capability 7.0 or newer; CPU: oneDNN fp16 kernels."""
        if self._cuda:
            if not torch.cuda.is_available():
                return True
            return torch.cuda.get_device_capability()[0] >= 7
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
        except (AttributeError, RuntimeError):
            return False

    def supported_dtypes(self) -> list[torch.dtype]:
        dtypes = [torch.float32]
        if self.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        if self.is_fp16_supported():
            dtypes.append(torch.float16)
        return dtypes

    # --- RNG ------------------------------------------------------------------------------

    def manual_seed(self, seed: int) -> Any:
        return torch.cuda.manual_seed(seed) if self._cuda else torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> Any:
        return torch.cuda.manual_seed_all(seed) if self._cuda else torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed() if self._cuda else torch.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        if self._cuda:
            return torch.cuda.get_rng_state("cuda" if device_index is None else device_index)
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.set_rng_state(new_state, "cuda" if device_index is None else device_index)
        else:
            torch.set_rng_state(new_state)

    # --- memory ---------------------------------------------------------------------------

    def _rss(self) -> int:
        rss = host_rss_bytes()
        self._max_rss = max(self._max_rss, rss)
        return rss

    def memory_allocated(self, device_index: int | None = None) -> int:
        """CUDA: bytes held by tensors; CPU: the process's resident set size."""
        if self._cuda:
            return torch.cuda.memory_allocated(device_index)
        return self._rss()

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.max_memory_allocated(device_index)
        self._rss()
        return self._max_rss

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)
        else:
            self._max_rss = host_rss_bytes()

    reset_peak_memory_stats = reset_max_memory_allocated

    def memory_reserved(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.memory_reserved(device_index)
        return self._rss()

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.max_memory_reserved(device_index)
        self._rss()
        return self._max_rss

    memory_cached = memory_reserved
    max_memory_cached = max_memory_reserved

    def empty_cache(self) -> None:
        """Return cached CUDA blocks to the driver (no-op on CPU)."""
        if self._cuda:
            torch.cuda.empty_cache()

    def total_memory(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def available_memory(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.mem_get_info(device_index)[0]
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        """Page-locked copy for fast host-to-device copies; on CPU the tensor itself (there
        is no device to copy to)."""
        return tensor.pin_memory() if self._cuda else tensor

    def unpin_memory(self, tensor: torch.Tensor) -> None:
        """Nothing to do, as in DeepSpeed with its default (torch) pinning backend: torch frees
        page-locked memory when the tensor is collected. Returns None, as DeepSpeed does."""
        return None

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return bool(tensor.is_pinned()) if self._cuda else False

    # --- streams and events ----------------------------------------------------------------

    @property
    def Stream(self) -> Any:
        return torch.cuda.Stream if self._cuda else None

    def stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream) if self._cuda else contextlib.nullcontext()

    def current_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.current_stream(device_index) if self._cuda else None

    def default_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.default_stream(device_index) if self._cuda else None

    @property
    def Event(self) -> Any:
        return torch.cuda.Event if self._cuda else None

    # --- graphs (DeepSpeed's accelerator names) ----------------------------------------------

    def create_graph(self) -> Any:
        """A new CUDA graph (None on CPU, which has no graphs)."""
        return torch.cuda.CUDAGraph() if self._cuda else None

    def capture_to_graph(
        self, graph: Any, pool: Any = None, stream: Any = None
    ) -> contextlib.AbstractContextManager[Any]:
        """Record the kernels launched inside the block into ``graph`` (not run them)."""
        if not self._cuda:
            return contextlib.nullcontext()
        return torch.cuda.graph(graph, pool=pool, stream=stream)

    def replay_graph(self, graph: Any) -> None:
        """Launch every kernel recorded in ``graph`` on its captured buffers."""
        if self._cuda:
            graph.replay()

    def range_push(self, msg: str) -> None:
        if self._cuda:
            torch.cuda.nvtx.range_push(msg)

    def range_pop(self) -> None:
        if self._cuda:
            torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback: Any) -> Any:
        return torch.cuda._lazy_call(callback) if self._cuda else callback()

    def is_triton_supported(self) -> bool:
        return (
            self._cuda and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8
        )
