"""Which rank caused a failed job: the launcher's report after torchelastic stops the ranks.

When one rank dies, its peers fail too: gloo and NCCL raise "Connection reset/closed by peer"
in the survivors within milliseconds, and the agent then stops every rank still running.
torchelastic's ``get_first_failure`` orders failures by a timestamp in whole seconds, and a
rank killed by a signal has no error file, so its time is when the agent *noticed* it. A
survivor's secondary error, written in the same second or just before, then looks first.

This module classifies each failure instead of trusting that order:

- ``stopped``: the launcher itself signalled the rank (after another rank failed) and the rank
  raised nothing before that; not a failure at all.
- ``secondary``: the rank's exception says it lost its connection to a peer; it failed only
  because another rank died.
- ``primary``: anything else (an exception, a nonzero exit, a signal from outside).

The cause is the earliest primary failure (exact times from the error file where there is one,
else torchelastic's); only when there is none is the earliest secondary one named.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

__all__ = [
    "RankFailure",
    "classify_failures",
    "format_report",
    "job_exit_status",
    "track_worker_stops",
]

# Messages of gloo, NCCL and the c10d store when the other end of a connection went away.
_PEER_LOST = re.compile(
    r"connection (reset|closed) by peer|broken pipe|remote process exited|"
    r"communicator was aborted|failed to recv, got 0 bytes",
    re.IGNORECASE,
)
_MESSAGE_CHARS = 300  # a secondary failure's message is shown up to this length
_SIGNALS = {int(s) for s in signal.Signals}


@dataclass(frozen=True)
class RankFailure:
    """One rank that exited nonzero, with what the launcher knows about why."""

    rank: int
    local_rank: int
    pid: int
    exitcode: int
    """The process's return code: negative ``-N`` when killed by signal N."""
    message: str
    """The exception line from the rank's error file ("" when there is none)."""
    error_file: str | None
    time: float
    """When it failed: exact for a recorded exception, else when the agent noticed it."""
    kind: str
    """``primary``, ``secondary`` or ``stopped`` (see the module docstring)."""
    signalled: bool = False
    """The launcher signalled it (after another rank failed)."""

    @property
    def ended_by_launcher(self) -> bool:
        """It raised, and the launcher's SIGTERM/SIGKILL ended it while it was exiting: its
        exit code is the launcher's, not its own."""
        return self.signalled and self.exitcode < 0 and bool(self.message)

    @property
    def exit_status(self) -> int:
        """The shell's view of the exit code: ``128 + N`` for signal N."""
        return 128 - self.exitcode if self.exitcode < 0 else self.exitcode

    def what(self) -> str:
        """ "was killed by SIGKILL (exit code 137)" or "failed with exit code 1"."""
        if self.ended_by_launcher:
            name = signal.Signals(-self.exitcode).name if -self.exitcode in _SIGNALS else "a signal"
            return f"failed (it raised, then the launcher's {name} ended it while it exited)"
        if self.exitcode < 0:
            try:
                name = signal.Signals(-self.exitcode).name
            except ValueError:
                name = f"signal {-self.exitcode}"
            return f"was killed by {name} (exit code {self.exit_status})"
        return f"failed with exit code {self.exitcode}"


@contextlib.contextmanager
def track_worker_stops() -> Iterator[dict[int, float]]:
    """Record which worker pids the agent signals to stop (pid -> time), while active.

    torchelastic reports the ranks it stopped itself among the failures, with the exit code
    of its SIGTERM/SIGKILL, so they cannot be told from a rank killed from outside. It also
    waits 30 s for a stopped rank to exit before its SIGKILL: a rank frozen by SIGSTOP keeps
    the SIGTERM pending until continued, so we send SIGCONT right after it.
    """
    stops: dict[int, float] = {}
    try:
        from torch.distributed.elastic.multiprocessing.subprocess_handler import (
            subprocess_handler as module,
        )

        handler_cls: Any = module.SubprocessHandler
        original = handler_cls.close
    except (ImportError, AttributeError):  # another torch layout: report without this
        yield stops
        return

    def close(self: Any, death_sig: signal.Signals | None = None) -> None:
        stops.setdefault(self.proc.pid, time.time())
        original(self, death_sig)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGCONT)

    handler_cls.close = close
    try:
        yield stops
    finally:
        handler_cls.close = original


def _message_and_time(failure: Any) -> tuple[str, float | None]:
    """The exception line and exact time from a torchelastic failure's error file."""
    if not os.path.isfile(failure.error_file):
        return "", None
    message = failure.message
    exact = None
    if isinstance(message, dict):  # torchelastic's structured error-file format
        extra = message.get("extraInfo") or {}
        with contextlib.suppress(TypeError, ValueError):
            exact = float(extra.get("time", ""))
        message = message.get("message", "")
    return str(message), exact if exact is not None else float(failure.timestamp)


def _kind(exitcode: int, message: str, exact: float | None, stopped_at: float | None) -> str:
    if message and _PEER_LOST.search(message):
        return "secondary"
    if stopped_at is not None and (exact is None or exact >= stopped_at):
        return "stopped"  # nothing was raised before the launcher's own signal
    return "primary"


def classify_failures(failures: dict[int, Any], stops: dict[int, float]) -> list[RankFailure]:
    """Turn torchelastic's ``{rank: ProcessFailure}`` into :class:`RankFailure` records, the
    cause first: primary failures by time, then secondary ones, then stopped ranks."""
    out = []
    for rank, failure in failures.items():
        message, exact = _message_and_time(failure)
        stopped_at = stops.get(failure.pid)
        kind = _kind(failure.exitcode, message, exact, stopped_at)
        when = exact if exact is not None else float(failure.timestamp)
        error_file = failure.error_file if os.path.isfile(failure.error_file) else None
        record = RankFailure(
            rank=rank, local_rank=failure.local_rank, pid=failure.pid, exitcode=failure.exitcode,
            message=message, error_file=error_file, time=when, kind=kind,
            signalled=stopped_at is not None,
        )  # fmt: skip
        out.append(record)
    order = {"primary": 0, "secondary": 1, "stopped": 2}
    return sorted(out, key=lambda f: (order[f.kind], f.time, f.rank))


def job_exit_status(failures: list[RankFailure]) -> int:
    """The launcher's exit code: the cause's, unless the launcher's own signal ended the cause
    (it raised first, but was still exiting when another rank's failure made the launcher
    stop everyone): then the code of the first rank that ended on its own (1 if none)."""
    cause = failures[0]
    if not cause.ended_by_launcher:
        return cause.exit_status
    own = [f for f in failures if not f.signalled]
    return own[0].exit_status if own else 1


def format_report(failures: list[RankFailure], output_hint: str | None) -> list[str]:
    """The launcher's lines: the cause first, then the ranks that failed only because of it.

    ``output_hint``: where the cause's output is when it left no traceback (a log path), or
    None for "its output is above".
    """
    cause = failures[0]
    if cause.error_file is not None:
        where = f"{cause.message}; traceback in {cause.error_file}"
    else:
        where = f"no Python traceback recorded; {output_hint or 'its output is above'}"
    head = f"slipstream run: rank {cause.rank} (local rank {cause.local_rank}, pid {cause.pid})"
    if cause.kind == "secondary":
        where += (
            "; it lost its connection to a peer, but no rank was seen failing before it "
            "(look for a rank killed outside the launcher, e.g. by the OOM killer)"
        )
    lines = [f"{head} {cause.what()}; {where}; the other ranks were stopped"]
    for other in failures[1:]:
        if other.kind != "secondary":
            continue
        text = other.message
        if len(text) > _MESSAGE_CHARS:
            text = text[:_MESSAGE_CHARS] + "..."
        lines.append(
            f"slipstream run: rank {other.rank} (local rank {other.local_rank}) failed only "
            f"because a peer died (secondary): {text}"
        )
    return lines
