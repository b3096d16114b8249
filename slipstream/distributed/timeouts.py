"""Collective timeouts: how long a collective may wait, and an error that names who is missing.

The timeout is ``SLIPSTREAM_COMM_TIMEOUT`` seconds (else DeepSpeed's ``DEEPSPEED_TIMEOUT``
minutes, else 600 s). Every call the comm layer issues goes through :func:`issue`: a torch
timeout, raised at once or by ``wait()`` on the returned work, becomes a
:class:`CollectiveTimeoutError` naming the collective (op, label, axis, number on its group),
this rank and the ranks that did not arrive (from the arrival records of
:mod:`slipstream.distributed._arrivals`).
"""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast

import torch.distributed as dist

from slipstream.distributed._arrivals import Arrival, arrivals, describe_peers
from slipstream.distributed._timeout_env import COMM_TIMEOUT_ENV, DEFAULT_COMM_TIMEOUT_S
from slipstream.distributed.groups import axis_name, get_local_rank, group_ranks

__all__ = [
    "COMM_TIMEOUT_ENV",
    "DEFAULT_COMM_TIMEOUT_S",
    "Call",
    "CollectiveTimeoutError",
    "comm_timeout",
    "issue",
    "note_timeout_in_use",
    "on_complete",
    "set_device_sync",
]

Group = dist.ProcessGroup | None

_DS_TIMEOUT_ENV = "DEEPSPEED_TIMEOUT"  # DeepSpeed's knob, in minutes
_TIMEOUT_IN_USE: dict[str, float] = {}  # what init_distributed passed to torch


def _positive_seconds(name: str, raw: str, scale: float) -> float:
    try:
        value = float(raw) * scale
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        unit = "minutes" if scale != 1 else "seconds"
        raise ValueError(
            f"{name}={raw!r}: expected a positive number of {unit}; unset it for the default "
            f"of {DEFAULT_COMM_TIMEOUT_S:.0f} s"
        )
    return value


def comm_timeout() -> timedelta:
    """How long a collective may wait for its peers before it fails.

    ``SLIPSTREAM_COMM_TIMEOUT`` (seconds) if set, else DeepSpeed's ``DEEPSPEED_TIMEOUT``
    (minutes), else :data:`DEFAULT_COMM_TIMEOUT_S`.

    Raises:
        ValueError: the variable is not a positive number (names it, the value and the fix).
    """
    raw = os.environ.get(COMM_TIMEOUT_ENV, "").strip()
    if raw:
        return timedelta(seconds=_positive_seconds(COMM_TIMEOUT_ENV, raw, 1.0))
    raw = os.environ.get(_DS_TIMEOUT_ENV, "").strip()
    if raw:
        return timedelta(seconds=_positive_seconds(_DS_TIMEOUT_ENV, raw, 60.0))
    return timedelta(seconds=DEFAULT_COMM_TIMEOUT_S)


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete within the process-group timeout; the message names
    the collective, this rank and the ranks that did not arrive."""


_TIMED_OUT = re.compile(r"timed out|timeout", re.IGNORECASE)


@dataclass(frozen=True)
class Call:
    """One issued communication call, kept to explain a timeout."""

    op: str
    group: Group
    label: str | None
    arrival: Arrival | None
    """Its number on the group (collectives); None for a send/recv (two ranks only)."""
    peer: int | None = None
    """The other global rank of a send/recv."""


def _explain_timeout(call: Call) -> str:
    """Name the call, this rank and who did not arrive (waits one arrival-publish interval)."""
    me, local = dist.get_rank(), get_local_rank()
    secs = _TIMEOUT_IN_USE.get("seconds")
    within = f"{secs:g} s" if secs else "the process-group timeout"
    label = f" {call.label!r}" if call.label else ""
    where = f"on rank {me} (local rank {local})"
    if call.arrival is None:
        direction, other = ("to", "recv") if call.op == "send" else ("from", "send")
        head = f"{call.op}{label} {direction} rank {call.peer} did not complete within {within}"
        who = (
            f"rank {call.peer} did not post the matching {other} (it is stalled, or the two "
            "ranks post their messages in different orders)"
        )
    else:
        ranks = group_ranks(call.group)
        head = (
            f"{call.op}{label} on axis '{axis_name(call.group)}' (collective "
            f"#{call.arrival.seq} on the group of ranks {ranks}) did not complete within {within}"
        )
        peers = arrivals.peers(call.arrival, [r for r in ranks if r != me])
        who = describe_peers(call.arrival, peers)
    return (
        f"{head} {where}: {who}. A rank that is stopped, deadlocked or busy with work the "
        "others do not wait for causes this; if the wait is legitimate (e.g. rank-0-only data "
        f"preparation), raise {COMM_TIMEOUT_ENV} (seconds; or `slipstream run --comm_timeout`)"
    )


def _raise_if_timed_out(err: RuntimeError, call: Call) -> None:
    if isinstance(err, CollectiveTimeoutError) or not _TIMED_OUT.search(str(err)):
        return
    raise CollectiveTimeoutError(_explain_timeout(call)) from err


Listener = Callable[[Call, float], None]
_LISTENERS: list[Listener] = []
_DEVICE_SYNC: list[Callable[[], None]] = []


def on_complete(listener: Listener) -> None:
    """Call ``listener(call, seconds)`` when a collective completes: a synchronous call when
    it returns, an asynchronous one when its ``wait()`` returns (seconds since it was issued;
    work never waited on is not reported)."""
    _LISTENERS.append(listener)


def set_device_sync(sync: Callable[[], None] | None) -> None:
    """Synchronize the device around every collective (``sync``), so the reported seconds
    are the collective's own on an accelerator whose calls return before they finish; None
    turns it off (the default: it serializes compute and communication)."""
    _DEVICE_SYNC[:] = [] if sync is None else [sync]


def _report(call: Call, start: float) -> None:
    for sync in _DEVICE_SYNC:
        sync()
    elapsed = time.perf_counter() - start
    for listener in _LISTENERS:
        listener(call, elapsed)


class _Watched:
    """An async call's Work whose ``wait()`` explains a timeout; anything else is forwarded."""

    def __init__(self, work: dist.Work, call: Call, start: float) -> None:
        self.work, self.call, self.start = work, call, start
        self._reported = False

    def wait(self, *args: Any) -> bool:
        try:
            done = bool(self.work.wait(*args))
        except RuntimeError as err:
            _raise_if_timed_out(err, self.call)
            raise
        if not self._reported:
            self._reported = True
            _report(self.call, self.start)
        return done

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


def issue(call: Call, start: Callable[[], dist.Work | None]) -> dist.Work | None:
    """Run ``start`` (the torch call); a timeout, now or at ``wait()``, names who is missing.
    Completion is reported to the ``on_complete`` listeners."""
    for sync in _DEVICE_SYNC:
        sync()
    begin = time.perf_counter()
    try:
        work = start()
    except RuntimeError as err:
        _raise_if_timed_out(err, call)
        raise
    if work is None:
        _report(call, begin)
        return None
    return cast(dist.Work, _Watched(work, call, begin))


def note_timeout_in_use(timeout: timedelta) -> None:
    """Record the timeout the default process group was made with (for the error message)."""
    _TIMEOUT_IN_USE["seconds"] = timeout.total_seconds()
