"""Measure this machine into a ``local`` hardware profile (``slipstream plan --calibrate``).

A few seconds of micro-benchmarks: the GEMM rate for square matrices of a few sizes (the
training dtype on an accelerator, fp32 on CPU), the device-memory copy bandwidth, and an
all-reduce between two processes (NCCL with two GPUs, gloo otherwise) at a small and a large
message, whose alpha-beta fit gives latency and bandwidth. A single machine has no
inter-node link: the profile reuses the measured link for it and says so in ``sources``.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Any

import torch

from slipstream.planner.hardware import Hardware, LinkTier, local_profile_path

__all__ = ["calibrate", "measure_allreduce", "measure_gemm"]

_SIZES = (256, 512, 1024)
_SMALL, _LARGE = 1 << 12, 1 << 24  # all-reduce message bytes


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _timed(fn: Any, repeat: int, device: torch.device) -> float:
    """Median seconds of ``fn()`` over ``repeat`` runs after one warm-up."""
    fn()
    samples = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return sorted(samples)[len(samples) // 2]


def measure_gemm(sizes: tuple[int, ...] = _SIZES, repeat: int = 5) -> list[tuple[float, float]]:
    """``(GFLOP, TFLOP/s)`` of ``n x n @ n x n`` for each ``n`` in ``sizes``."""
    device = _device()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    points = []
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        seconds = _timed(lambda a=a, b=b: torch.mm(a, b), repeat, device)
        flops = 2.0 * n**3
        points.append((flops / 1e9, flops / seconds / 1e12))
    return points


def measure_memory_bandwidth(nbytes: int = 1 << 26, repeat: int = 5) -> float:
    """GB/s of a device-memory copy (read + write counted)."""
    device = _device()
    src = torch.empty(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    seconds = _timed(lambda: dst.copy_(src), repeat, device)
    return 2 * nbytes / seconds / 1e9


def _allreduce_worker(rank: int, port: int, queue: Any) -> None:
    """One of two processes: time all-reduces through slipstream's comm layer."""
    from slipstream.distributed import comm

    backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    os.environ["LOCAL_RANK"] = str(rank)
    comm.init_distributed(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                          world_size=2)  # fmt: skip
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    result = {}
    for nbytes in (_SMALL, _LARGE):
        t = torch.ones(nbytes // 4, device=device)
        result[nbytes] = _timed(lambda t=t: comm.all_reduce(t), 5, device)
    comm.destroy_process_group()
    if rank == 0:
        queue.put(result)


def measure_allreduce(timeout_s: float = 60.0) -> tuple[float, float]:
    """(latency seconds, bus bandwidth bytes/s) of a 2-process all-reduce.

    A ring all-reduce of ``S`` bytes over 2 ranks costs ``2 alpha + S / beta``; two message
    sizes give both. The two processes are killed if they outlive ``timeout_s``.
    """
    from slipstream.distributed.comm import _free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_allreduce_worker, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        result = queue.get(timeout=timeout_s)
    except Exception as err:
        raise RuntimeError(
            f"all-reduce calibration between 2 processes did not finish in {timeout_s:.0f} s"
        ) from err
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    t_small, t_large = result[_SMALL], result[_LARGE]
    bandwidth = (_LARGE - _SMALL) / max(t_large - t_small, 1e-9)
    latency = max((t_small - _SMALL / bandwidth) / 2, 1e-7)
    return latency, bandwidth


def _device_memory() -> int:
    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(0).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def calibrate(path: str | os.PathLike[str] | None = None) -> Hardware:
    """Measure this machine, write the profile to ``path`` (default :func:`local_profile_path`)
    and return it."""
    gemm = measure_gemm()
    latency, bandwidth = measure_allreduce()
    on_gpu = torch.cuda.is_available()
    devices = torch.cuda.device_count() if on_gpu else max(2, os.cpu_count() or 2)
    gbps = bandwidth / 1e9
    profile = Hardware(
        name="local",
        peak_tflops=max(r for _, r in gemm),
        gemm_tflops=tuple(gemm),
        memory_bytes=_device_memory(),
        memory_usable_fraction=0.9,
        memory_bandwidth_gbps=measure_memory_bandwidth(),
        memory_efficiency=1.0,
        devices_per_node=devices,
        intra_node=(LinkTier(devices, gbps),),
        intra_node_latency_s=latency,
        intra_node_efficiency=1.0,
        node_bandwidth_gbps=gbps * devices,
        inter_node_latency_s=latency,
        inter_node_efficiency=1.0,
        host_bandwidth_gbps=gbps,
        sources={
            "peak_tflops": "measured: the best GEMM rate seen (no vendor peak is known here)",
            "gemm_tflops": f"measured: torch.mm of square {list(_SIZES)} matrices",
            "memory_bandwidth_gbps": "measured: a 64 MiB device copy (read + write)",
            "intra_node": f"measured: 2-process all-reduce at {_SMALL} and {_LARGE} bytes "
            f"({'nccl' if on_gpu and devices >= 2 else 'gloo'}), alpha-beta fit",
            "node_bandwidth_gbps": "not measured (one machine): the intra-node link times "
            "the device count",
            "devices_per_node": "GPUs visible, or CPU cores on a CPU-only machine",
        },
    )
    target = Path(path) if path else local_profile_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(profile.to_dict(), indent=2) + "\n")
    return profile
