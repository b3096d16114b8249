"""Per-rank entry point: ``python -u .../slipstream/cli/_rank_entry.py [opts] TARGET ARGS...``.

torchrun starts every worker with the same argv and sets ``LOCAL_RANK`` in the environment,
but DeepSpeed scripts parse ``--local_rank`` from argv. This module runs inside each worker,
reads ``LOCAL_RANK`` and runs the user script with ``--local_rank=N`` placed first in its
argv (where DeepSpeed puts it), keeping ``__name__ == "__main__"`` semantics.

Options (before TARGET): ``--module`` (TARGET is a module, run like ``python -m``),
``--exec`` (TARGET is an executable: replace this process with it, for ``--no_python``) and
``--no_local_rank`` (do not add ``--local_rank``).

The worker dies with its launcher: the first thing it does is ask Linux for SIGKILL when its
parent (the launcher's agent, which started it) dies, then check that the parent is still the
launcher named in ``SLIPSTREAM_LAUNCHER_PID`` (it may have died between our fork and the
request). Without this a launcher killed by SIGKILL leaves its ranks training on as orphans:
torchelastic starts each worker in a new session, so no terminal or group signal reaches them.
The request survives ``exec``, so ``--exec`` targets are covered too.

An uncaught exception is also written to ``TORCHELASTIC_ERROR_FILE`` in torchelastic's
format (plus the exact time, so the launcher can order failures finer than a second), so the
launcher can point at the failing rank's traceback.

It is run by file path, not ``-m``, and imports only the standard library: ``-m`` would
import the ``slipstream`` package (and torch) before the user script, so the script could no
longer decide what is imported first (e.g. set environment variables before torch loads).
"""

from __future__ import annotations

import ctypes
import json
import os
import runpy
import signal
import sys
import time
import traceback

_OPTIONS = ("--module", "--exec", "--no_local_rank")
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
LAUNCHER_PID_ENV = "SLIPSTREAM_LAUNCHER_PID"


def die_with_launcher() -> None:
    """Get SIGKILL when the parent dies; exit now if it is already gone (Linux only).

    SIGKILL rather than SIGTERM: a user SIGTERM handler (save on preemption) would run a
    collective with peers that are dying too and hang; nothing is left to report to anyway.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return  # best effort: a sandbox may forbid prctl; the launcher still stops us
    except (OSError, AttributeError):
        return
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if launcher and launcher.isdigit() and os.getppid() != int(launcher):
        # The launcher died before prctl took effect: we were re-parented and no signal comes.
        os.kill(os.getpid(), signal.SIGKILL)


def _split_argv(argv: list[str]) -> tuple[set[str], str, list[str]]:
    """Split ``argv`` into (entry options, target, target args)."""
    opts: set[str] = set()
    i = 0
    while i < len(argv) and argv[i] in _OPTIONS:
        opts.add(argv[i])
        i += 1
    if i >= len(argv):
        raise SystemExit("slipstream.cli._rank_entry: missing the script (or module) to run")
    return opts, argv[i], argv[i + 1 :]


def _set_deepspeed_env() -> None:
    """Add the variables DeepSpeed's launcher sets that torchrun names differently."""
    local_size = os.environ.get("LOCAL_WORLD_SIZE")
    if local_size is not None:
        os.environ.setdefault("LOCAL_SIZE", local_size)
    if "GROUP_RANK" in os.environ:
        os.environ.setdefault("CROSS_RANK", os.environ["GROUP_RANK"])
    world, local = os.environ.get("WORLD_SIZE"), local_size
    if world and local and int(local) > 0:
        os.environ.setdefault("CROSS_SIZE", str(int(world) // int(local)))


def _bind_cores() -> None:
    """``--bind_cores_to_rank``: pin this rank to its share of the launcher's core list and
    size OpenMP to it (DeepSpeed's split: equal consecutive shares in local-rank order)."""
    listed = os.environ.get("SLIPSTREAM_BIND_CORES")
    if not listed:
        return
    cores = [int(c) for c in listed.split(",")]
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    per_rank = len(cores) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    mine = cores[per_rank * local_rank : per_rank * (local_rank + 1)]
    try:
        os.sched_setaffinity(0, mine)
    except OSError as err:
        msg = f"--bind_cores_to_rank: rank {local_rank} cannot use cores {mine}: {err}"
        raise SystemExit(msg) from None
    os.environ["OMP_NUM_THREADS"] = str(per_rank)


def _record_exception(exc: BaseException) -> None:
    """Write ``exc`` to the torchelastic error file (same JSON as torch's ErrorHandler)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    now = time.time()
    data = {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {
                "py_callstack": traceback.format_exc(),
                "timestamp": str(int(now)),
                "time": repr(now),
            },
        }
    }
    try:
        with open(path, "w") as fp:
            json.dump(data, fp)
    except OSError:
        pass  # reporting is best effort; the traceback still reaches stderr


def main(argv: list[str] | None = None) -> None:
    """Run the target named in ``argv`` (default ``sys.argv[1:]``) as this rank's ``__main__``."""
    opts, target, args = _split_argv(sys.argv[1:] if argv is None else argv)
    if "--no_local_rank" not in opts:
        args = [f"--local_rank={os.environ.get('LOCAL_RANK', '0')}", *args]
    _set_deepspeed_env()
    _bind_cores()
    if "--exec" in opts:
        os.execvp(target, [target, *args])
    try:
        sys.argv = [target, *args]
        if "--module" in opts:
            sys.path[0] = os.getcwd()  # as `python -m`: the cwd comes first
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(target))  # as `python script.py`
            runpy.run_path(target, run_name="__main__")
    except Exception as exc:
        _record_exception(exc)
        raise


if __name__ == "__main__":
    die_with_launcher()
    main()
