"""What the communication layer does at the edges of a job: let gloo's threads go idle before
the interpreter finalizes, and say where two ranks' values first differ."""

from __future__ import annotations

import os
import time
from typing import Any

from slipstream._logging import logger

__all__ = ["first_difference", "settle_comm_threads"]

_COMM_THREADS = ("pt_gloo", "gloo_")  # gloo's worker and transport threads (Linux names)


def _runnable_comm_threads() -> int:
    """How many of this process's gloo threads are running or waiting for a CPU (Linux)."""
    count = 0
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return 0
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as fp:
                stat = fp.read()
        except OSError:
            continue
        name, state = stat[stat.find("(") + 1 : stat.rfind(")")], stat[stat.rfind(")") + 2 :][:1]
        count += name.startswith(_COMM_THREADS) and state == "R"
    return count


def settle_comm_threads(timeout_s: float = 2.0, quiet_polls: int = 3) -> bool:
    """Let gloo's worker threads finish with their last work items before the interpreter
    finalizes; returns False if they were still busy after ``timeout_s``.

    ``destroy_process_group`` does not stop those threads while Python objects (an engine
    the script still holds) reference the groups. A worker that finished a collective
    still holds the work item, and when it lets go after the script dropped the tensors
    (``all_gather_object``'s temporaries at the end of ``save_checkpoint``), freeing them
    takes the GIL: during interpreter finalization that aborts the process ("terminate
    called without an active exception", exit 134). On a loaded machine a worker can wait
    long for a CPU in that window; so wait, with the GIL released, until none has been
    runnable for ``quiet_polls`` polls 5 ms apart.
    """
    deadline = time.monotonic() + timeout_s
    quiet = 0
    while quiet < quiet_polls:
        if time.monotonic() > deadline:
            logger.debug("gloo threads still busy %.1f s after the process group ended", timeout_s)
            return False
        time.sleep(0.005)
        quiet = quiet + 1 if _runnable_comm_threads() == 0 else 0
    return True


def first_difference(mine: Any, theirs: Any, me: int, other: int) -> str:
    """Where two ranks' values first differ: the first differing item of two sequences
    (a parameter of a model's list), or the whole values, each shown up to 300 characters."""
    if isinstance(mine, list | tuple) and isinstance(theirs, list | tuple):
        for i, (a, b) in enumerate(zip(mine, theirs)):
            if a != b:
                return (
                    f"the first difference is item {i}: this rank ({me}) has {a!r:.300}, "
                    f"rank {other} has {b!r:.300}"
                )
        if len(mine) != len(theirs):
            n = min(len(mine), len(theirs))
            extra = mine[n] if len(mine) > n else theirs[n]
            return (
                f"this rank ({me}) has {len(mine)} items, rank {other} {len(theirs)}; the "
                f"first {n} agree, then {'this rank' if len(mine) > n else f'rank {other}'} "
                f"has {extra!r:.300}"
            )
    return f"this rank ({me}) has {mine!r:.300}, rank {other} has {theirs!r:.300}"
