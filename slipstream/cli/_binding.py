"""``--bind_cores_to_rank`` / ``--bind_core_list``: each local rank on its own CPU cores.

As DeepSpeed's launcher: the cores (``--bind_core_list``, e.g. ``0-3,8-11``, else the
machine's physical cores ``0..P-1``) are split evenly over the local ranks in order; rank
``r`` gets ``cores[r*k:(r+1)*k]`` with ``k = len(cores) // nproc``, and ``OMP_NUM_THREADS``
is ``k``. The launcher computes the list; each worker (``_rank_entry``) pins itself with
``sched_setaffinity`` before the script starts. DeepSpeed runs the worker under ``numactl``
and also binds memory to the cores' NUMA node; slipstream binds the CPUs only (no numactl
needed; the kernel's first-touch policy places memory on the local node anyway).
"""

from __future__ import annotations

import os
from pathlib import Path

from slipstream.cli._hostfile import LaunchError

__all__ = ["BIND_CORES_ENV", "parse_core_list", "physical_core_count", "plan_core_binding"]

BIND_CORES_ENV = "SLIPSTREAM_BIND_CORES"
"""The expanded core list (``0,1,2,3``) the workers split among themselves."""


def parse_core_list(text: str) -> list[int]:
    """``"0-3,8,10-11"`` -> ``[0, 1, 2, 3, 8, 10, 11]``; ranges ascending, not overlapping.

    Raises:
        LaunchError: bad syntax, a descending range, or overlapping/unordered ranges.
    """
    cores: list[int] = []
    for part in text.split(","):
        bounds = part.strip().split("-")
        try:
            lo, hi = (int(bounds[0]), int(bounds[-1])) if len(bounds) <= 2 else (0, -1)
        except ValueError:
            lo, hi = 0, -1
        if len(bounds) > 2 or lo > hi or lo < 0:
            raise LaunchError(
                f"--bind_core_list {text!r}: {part.strip()!r} is not a core or a range "
                "like 4-7 (start <= end)"
            )
        if cores and lo <= cores[-1]:
            raise LaunchError(
                f"--bind_core_list {text!r}: ranges must be in ascending order and must not overlap"
            )
        cores.extend(range(lo, hi + 1))
    return cores


def physical_core_count() -> int:
    """Physical cores (not hyper-threads) of this machine; the logical count if unknown."""
    seen = set()
    for cpu in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/topology"):
        try:
            seen.add(((cpu / "physical_package_id").read_text(), (cpu / "core_id").read_text()))
        except OSError:
            continue
    return len(seen) or (os.cpu_count() or 1)


def plan_core_binding(bind_core_list: str | None, nproc: int) -> list[int]:
    """The cores the ``nproc`` local ranks split, checked as DeepSpeed checks them.

    Raises:
        LaunchError: ``KMP_AFFINITY`` is set (it overrides the binding), or fewer cores than
            ranks.
    """
    if "KMP_AFFINITY" in os.environ:
        raise LaunchError(
            "--bind_cores_to_rank: KMP_AFFINITY is set and would override the per-rank core "
            "binding; unset KMP_AFFINITY"
        )
    cores = (
        parse_core_list(bind_core_list)
        if bind_core_list is not None
        else list(range(physical_core_count()))
    )
    if len(cores) < nproc:
        raise LaunchError(
            f"--bind_cores_to_rank: {len(cores)} cores for {nproc} ranks; every rank needs at "
            "least one core (use fewer ranks or a longer --bind_core_list)"
        )
    return cores
