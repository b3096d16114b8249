"""Run a function on N gloo ranks in fresh processes and collect each rank's return value."""

from __future__ import annotations

import os
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(
    rank: int, fn: Callable[..., Any], world: int, port: int, outdir: str, args: tuple[Any, ...]
) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        SLIPSTREAM_COMM_TIMEOUT="120",
    )
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(*args)
        torch.save(result, Path(outdir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_world(
    fn: Callable[..., Any], world: int, *args: Any, timeout_s: float | None = None
) -> list[Any]:
    """Spawn ``world`` processes running ``fn(*args)`` under gloo; return per-rank results.

    ``fn`` must be importable (a module-level function of a test module). A world still
    running after ``timeout_s`` (default ``SLIPSTREAM_TEST_WORLD_TIMEOUT`` or 600 s) is
    killed and the test fails with a ``TimeoutError``: a hang never blocks the suite.
    """
    if timeout_s is None:
        timeout_s = float(os.environ.get("SLIPSTREAM_TEST_WORLD_TIMEOUT", "600"))
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(
            _entry,
            args=(fn, world, _free_port(), outdir, args),
            nprocs=world,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                for p in ctx.processes:
                    p.kill()
                    p.join()
                raise TimeoutError(
                    f"{fn.__qualname__} on {world} ranks did not finish within {timeout_s:.0f} s "
                    "(killed; SLIPSTREAM_TEST_WORLD_TIMEOUT sets the limit)"
                )
        return [torch.load(Path(outdir) / f"rank{r}.pt", weights_only=False) for r in range(world)]
