"""Measure this machine into a ``local`` hardware profile (``slipstream plan --calibrate``).

A few seconds of micro-benchmarks in ``nproc`` processes at once, each measuring what one rank
gets while the others run: the GEMM rate for square matrices of a few sizes (the training
dtype on an accelerator, fp32 on CPU, where each rank has ``cores // nproc`` threads), the
rate of causal SDPA forward and backward against a GEMM of the same FLOPs (the attention
core's efficiency), the device-memory copy bandwidth, and an all-reduce over the ``nproc`` processes (NCCL with a GPU
each, gloo otherwise) at a small and a large message, whose fit to the ring model gives
latency and bandwidth. A single machine has no
inter-node link: the profile reuses the measured link for it and says so in ``sources``.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from slipstream.planner.hardware import Hardware, LinkTier, local_profile_path

__all__ = ["calibrate", "measure_allreduce", "measure_attention", "measure_gemm"]

_SIZES = (256, 512, 1024)
_SMALL, _LARGE = 1 << 12, 1 << 24  # all-reduce message bytes


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


_MIN_SECONDS = 0.4  # each rate is averaged over at least this long


def _timed(fn: Any, device: torch.device, min_seconds: float = _MIN_SECONDS) -> float:
    """Mean seconds of ``fn()`` over as many runs as fit in ``min_seconds`` (after one
    warm-up). A mean over a long window, not a median of short runs: when ranks share cores
    the scheduler hands out time slices of milliseconds, and only a window much longer than
    one slice sees a rank's true share."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    runs, start = 0, time.perf_counter()
    while True:
        fn()
        runs += 1
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds and runs >= 3:
            return elapsed / runs


def measure_gemm(
    sizes: tuple[int, ...] = _SIZES, sync: Callable[[], None] | None = None
) -> list[tuple[float, float]]:
    """``(GFLOP, TFLOP/s)`` of ``n x n @ n x n`` for each ``n`` in ``sizes``; ``sync`` (a
    barrier) lines up the ranks that measure together before each size."""
    device = _device()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    points = []
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        if sync is not None:
            sync()
        seconds = _timed(lambda a=a, b=b: torch.mm(a, b), device)
        flops = 2.0 * n**3
        points.append((flops / 1e9, flops / seconds / 1e12))
    return points


def measure_attention(sync: Callable[[], None] | None = None) -> tuple[float, float]:
    """``(GFLOP, TFLOP/s)`` of causal ``scaled_dot_product_attention`` forward and backward,
    FLOPs counted as ``3 x 4 b s^2 (heads x head_dim)`` (unmasked, as the planner counts
    them). A GPT-sized shape: on CPU batch 2, 8 heads of 64, 256 tokens in fp32; on a GPU
    batch 2, 16 heads of 128, 2048 tokens in bf16."""
    device = _device()
    if device.type == "cuda":
        b, heads, s, d, dtype = 2, 16, 2048, 128, torch.bfloat16
    else:
        b, heads, s, d, dtype = 2, 8, 256, 64, torch.float32
    q, k, v = (
        torch.randn(b, heads, s, d, device=device, dtype=dtype, requires_grad=True)
        for _ in range(3)
    )
    grad = torch.randn(b, heads, s, d, device=device, dtype=dtype)

    def step() -> None:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(grad)
        q.grad = k.grad = v.grad = None

    if sync is not None:
        sync()
    seconds = _timed(step, device)
    flops = 3 * 4.0 * b * s * s * heads * d
    return flops / 1e9, flops / seconds / 1e12


def measure_memory_bandwidth(nbytes: int = 1 << 26) -> float:
    """GB/s of a device-memory copy (read + write counted)."""
    device = _device()
    src = torch.empty(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    seconds = _timed(lambda: dst.copy_(src), device)
    return 2 * nbytes / seconds / 1e9


def _timed_count(fn: Any, count: int, device: torch.device) -> float:
    """Mean seconds of ``fn()`` over ``count`` runs after one warm-up."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(count):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / count


def _threads_per_rank(nproc: int) -> int:
    """The CPU threads each of ``nproc`` ranks gets (what ``slipstream run`` sets)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cpus or 1) // nproc)


def _rank_worker(rank: int, nproc: int, port: int, queue: Any) -> None:
    """One of ``nproc`` processes: measure what one rank gets while all of them run (GEMM,
    memory copy, side by side), then time all-reduces through slipstream's comm layer."""
    from slipstream.distributed import comm

    backend = "nccl" if torch.cuda.device_count() >= nproc else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(_threads_per_rank(nproc))
    os.environ["LOCAL_RANK"] = str(rank)
    comm.init_distributed(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                          world_size=nproc)  # fmt: skip
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    result: dict[str, Any] = {"gemm": measure_gemm(sync=comm.barrier)}
    result["attention"] = measure_attention(sync=comm.barrier)
    comm.barrier()
    result["memory_gbps"] = measure_memory_bandwidth()
    for nbytes in (_SMALL, _LARGE):
        t = torch.ones(nbytes // 4, device=device)
        comm.barrier()
        # Every rank runs the same number of all-reduces (a collective cannot be timed by
        # each rank for its own duration): 20 small ones, 3 large ones.
        result[str(nbytes)] = _timed_count(lambda t=t: comm.all_reduce(t), 20 if nbytes == _SMALL
                                      else 3, device)  # fmt: skip
    comm.barrier()  # nobody tears gloo down while a peer is still in a collective
    comm.destroy_process_group()
    queue.put((rank, result))


def _measure_ranks(nproc: int, timeout_s: float) -> list[dict[str, Any]]:
    """Run :func:`_rank_worker` in ``nproc`` processes; kill them if they outlive
    ``timeout_s``."""
    from slipstream.distributed.comm import _free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_worker, args=(r, nproc, port, queue))
             for r in range(nproc)]  # fmt: skip
    for p in procs:
        p.start()
    results: dict[int, dict[str, Any]] = {}
    try:
        while len(results) < nproc:
            rank, result = queue.get(timeout=timeout_s)
            results[rank] = result
    except Exception as err:
        raise RuntimeError(
            f"calibration over {nproc} processes did not finish in {timeout_s:.0f} s"
        ) from err
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    return [results[r] for r in range(nproc)]


def _fit_allreduce(t_small: float, t_large: float, nproc: int) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) of the ring all-reduce model of ``network``:
    ``2 (g-1) (S / g / bw + alpha)`` over ``g`` ranks, fitted to two message sizes."""
    steps = 2 * (nproc - 1)
    bandwidth = steps * (_LARGE - _SMALL) / nproc / max(t_large - t_small, 1e-9)
    latency = max(t_small / steps - _SMALL / nproc / bandwidth, 1e-7)
    return latency, bandwidth


def measure_allreduce(timeout_s: float = 60.0, nproc: int = 2) -> tuple[float, float]:
    """(latency seconds, per-link bandwidth bytes/s) of an ``nproc``-process all-reduce."""
    ranks = _measure_ranks(nproc, timeout_s)
    slowest = max(ranks, key=lambda r: r[str(_LARGE)])
    return _fit_allreduce(slowest[str(_SMALL)], slowest[str(_LARGE)], nproc)


def _device_memory() -> int:
    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(0).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def calibrate(path: str | os.PathLike[str] | None = None, nproc: int | None = None) -> Hardware:
    """Measure this machine as ``nproc`` ranks share it, write the profile to ``path``
    (default :func:`local_profile_path`) and return it.

    A device of the profile is what one rank gets: on a GPU machine its GPU, on a CPU its
    share of the cores (``cores // nproc`` threads, every rank busy at once). ``nproc``
    defaults to the GPU count (at least 2) on a GPU machine and 2 on a CPU; calibrate with
    the ranks per node you will train with.
    """
    on_gpu = torch.cuda.is_available()
    if nproc is None:
        nproc = max(2, torch.cuda.device_count()) if on_gpu else 2
    if nproc < 2:
        raise ValueError(f"calibrate: nproc = {nproc}; the all-reduce needs at least 2 ranks")
    ranks = _measure_ranks(nproc, timeout_s=60.0 + 30.0 * nproc)
    # The slowest rank sets the pace of a synchronous step: take each rate's minimum.
    gemm = [
        (ranks[0]["gemm"][i][0], min(r["gemm"][i][1] for r in ranks))
        for i in range(len(ranks[0]["gemm"]))
    ]
    slowest = max(ranks, key=lambda r: r[str(_LARGE)])
    latency, bandwidth = _fit_allreduce(slowest[str(_SMALL)], slowest[str(_LARGE)], nproc)
    attention_gflop = ranks[0]["attention"][0]
    attention_rate = min(r["attention"][1] for r in ranks)
    backend = "nccl" if on_gpu and torch.cuda.device_count() >= nproc else "gloo"
    gbps = bandwidth / 1e9
    share = "" if backend == "nccl" else f", {_threads_per_rank(nproc)} threads per rank"
    gemm_only = Hardware(
        name="local",
        peak_tflops=max(r for _, r in gemm),
        gemm_tflops=tuple(gemm),
        memory_bytes=_device_memory() // (1 if on_gpu else nproc),
        memory_usable_fraction=0.9,
        memory_bandwidth_gbps=min(r["memory_gbps"] for r in ranks),
        memory_efficiency=1.0,
        devices_per_node=nproc,
        intra_node=(LinkTier(nproc, gbps),),
        intra_node_latency_s=latency,
        intra_node_efficiency=1.0,
        node_bandwidth_gbps=gbps * nproc,
        inter_node_latency_s=latency,
        inter_node_efficiency=1.0,
        host_bandwidth_gbps=gbps,
        attention_efficiency=1.0,
        reduce_scatter_scratch=backend == "gloo",
        sources={
            "peak_tflops": "measured: the best GEMM rate seen (no vendor peak is known here)",
            "gemm_tflops": f"measured: torch.mm of square {list(_SIZES)} matrices in each of "
            f"{nproc} ranks at once{share}; the slowest rank's rate",
            "memory_bandwidth_gbps": f"measured: a 64 MiB copy (read + write) in each of "
            f"{nproc} ranks at once; the slowest",
            "intra_node": f"measured: {nproc}-process all-reduce at {_SMALL} and {_LARGE} "
            f"bytes ({backend}), fitted to the ring model (latency per step, bandwidth per "
            "link)",
            "node_bandwidth_gbps": "not measured (one machine): the intra-node link times "
            "the device count",
            "devices_per_node": f"the ranks calibrated ({nproc})",
            "memory_bytes": "the GPU's memory" if on_gpu else f"host memory / {nproc} ranks",
            "reduce_scatter_scratch": f"the backend ({backend}): gloo's reduce-scatter "
            "stages a copy of its input in slipstream",
            "attention_efficiency": f"measured: causal SDPA forward + backward in each of "
            f"{nproc} ranks at once (the slowest) over the GEMM rate at the same FLOPs",
        },
    )
    efficiency = attention_rate * 1e12 / gemm_only.gemm_rate(attention_gflop)
    profile = dataclasses.replace(gemm_only, attention_efficiency=round(efficiency, 4))
    target = Path(path) if path else local_profile_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(profile.to_dict(), indent=2) + "\n")
    return profile
