"""What the communication layer does at the edges of a job: bound every wait at exit, let
gloo's threads go idle before the interpreter finalizes, end a process whose teardown is stuck,
and say where two ranks' values first differ."""

from __future__ import annotations

import os
import shutil
import sys
import time
from datetime import timedelta
from typing import Any

from slipstream._logging import logger

__all__ = [
    "EXIT_TIMEOUT_ENV",
    "arm_exit_watchdog",
    "exit_timeout_s",
    "first_difference",
    "settle_comm_threads",
    "wait_at_exit",
]

EXIT_TIMEOUT_ENV = "SLIPSTREAM_EXIT_TIMEOUT"
DEFAULT_EXIT_TIMEOUT_S = 300.0

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


def exit_timeout_s() -> float:
    """``SLIPSTREAM_EXIT_TIMEOUT`` (seconds, default 300; 0: no limit): how long slipstream's
    exit hooks wait for in-flight work, and how long the process may then take to finalize.

    Raises:
        ValueError: the variable is not a number >= 0 (names it, the value and the fix).
    """
    raw = os.environ.get(EXIT_TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_EXIT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise ValueError(
            f"{EXIT_TIMEOUT_ENV}={raw!r}: expected seconds, a number >= 0 (0: no limit); unset "
            f"it for the default of {DEFAULT_EXIT_TIMEOUT_S:.0f} s"
        )
    return value


def wait_at_exit(work: Any, what: str, deadline: float | None) -> bool:
    """Wait for ``work`` (a ``torch.distributed`` work object) until ``deadline``
    (``time.monotonic()``; None: no limit); False, with a warning naming ``what``, when it
    did not finish (a peer that neither takes part nor exits) or failed (a peer gone)."""
    try:
        if deadline is None:
            work.wait()
        else:
            work.wait(timedelta(seconds=max(0.001, deadline - time.monotonic())))
        return True
    except Exception as err:  # a timeout, or the peer closed its connection
        logger.warning(
            "at exit: gave up waiting for %s (%s); exiting without it",
            what,
            str(err).splitlines()[0][:300] if str(err) else type(err).__name__,
        )
        return False


# The watchdog: a shell process waits (``tail --pid``) until this one is gone; if it is still
# alive after the timeout, the threads it has and what each waits on (kernel wait channel) are
# written to its stderr and it is killed. No Python thread could do this: during interpreter
# finalization a thread that wants the GIL is ended, and C++ static destructors run after it.
_WATCHDOG = r"""
timeout "$1" tail --pid="$2" -f /dev/null >/dev/null 2>&1
[ $? -eq 124 ] || exit 0
grep -q '^State:.*Z' "/proc/$2/status" 2>/dev/null && exit 0
[ -d "/proc/$2" ] || exit 0
threads=""
for t in /proc/$2/task/*; do
  threads="$threads $(cat $t/comm 2>/dev/null)($(cat $t/wchan 2>/dev/null))"
done
printf '%s\n' "$3 threads (name(kernel wait)):$threads; ending it (SIGKILL). $4" > "/proc/$2/fd/2"
kill -9 "$2"
"""


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def arm_exit_watchdog(timeout_s: float, who: str) -> int | None:
    """After slipstream's exit hooks: end this process if it is still alive ``timeout_s``
    later (interpreter finalization or C++ teardown stuck), saying so on its stderr, so that
    a stuck teardown is a slow exit, never a hang. Returns the watchdog's pid (None: Linux
    tools missing, or ``timeout_s`` 0)."""
    tools = [shutil.which(t) for t in ("sh", "timeout", "tail")]
    if timeout_s <= 0 or not sys.platform.startswith("linux") or None in tools:
        return None
    pid = os.getpid()
    message = (
        f"slipstream: {who} (pid {pid}) is still alive {timeout_s:g} s after its exit hooks "
        "finished: interpreter finalization or C++ teardown is stuck;"
    )
    fix = f"{EXIT_TIMEOUT_ENV} sets the limit (seconds; 0: none)"
    # Nothing of this process's may stay open in the watchdog: a socket it inherited would
    # keep a peer from seeing this rank's connections close when it exits.
    actions: list[tuple[Any, ...]] = [
        (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
        (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
        (os.POSIX_SPAWN_DUP2, 1, 2),
    ]
    try:
        fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        return None
    actions += [(os.POSIX_SPAWN_CLOSE, fd) for fd in fds if fd > 2 and _is_open(fd)]
    argv = ["sh", "-c", _WATCHDOG, "sh", f"{timeout_s:g}", str(pid), message, fix]
    try:
        return os.posix_spawn(tools[0], argv, dict(os.environ), file_actions=actions)  # type: ignore[arg-type]
    except OSError as err:  # best effort: without it a stuck teardown still hangs
        logger.debug("exit watchdog not started: %s", err)
        return None


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
