"""Arrival records: which collective each rank last entered, so a timeout can name the laggard.

A collective that times out only tells the waiting rank that *someone* did not come. To say
who, every rank counts the collectives it enters per process group (ranks of a group issue
them in the same order, so "collective #N on group G" is the same call everywhere) and a
background thread publishes this rank's counts to the job's key-value store about once a
second, only when they changed. The hot path is a dict update (well under a microsecond); the
store sees one small write per rank per second while collectives run.

On a timeout, the waiting rank reads its peers' records after a short grace (their own
threads publish within one interval of arriving): peers whose count on the group is below N
did not arrive, and their last collective says where they are; a count above N means the
ranks issued different collectives. A rank frozen by SIGSTOP or deadlocked in user code stops
counting, which is exactly what is reported.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from slipstream._logging import logger

__all__ = ["Arrival", "ArrivalBoard", "PeerState", "arrivals", "describe_peers"]

_PREFIX = "slipstream/arrivals/"
_PUBLISH_INTERVAL_S = 1.0
_STOP_JOIN_S = 2.0


@dataclass(frozen=True)
class Arrival:
    """This rank entering one collective: the group's cross-rank name and its number there."""

    group: str
    seq: int
    op: str
    label: str | None


@dataclass(frozen=True)
class PeerState:
    """What a peer's published record says about one group."""

    rank: int
    seq: int
    """Collectives it entered on the group (0: none, or no record published)."""
    op: str | None
    label: str | None
    published: bool
    where: str = ""
    """"host h, local rank l, pid p" from its record (to find the process)."""
    age_s: float | None = None
    """How old the record was when read: the peer may have gone further since (a record is
    published at most once a second)."""


def _group_name(group: Any) -> str:
    """A name for ``group`` that is the same on every rank (torch assigns it in creation order)."""
    g = dist.GroupMember.WORLD if group is None else group
    if g is None:
        return "world"  # not initialized: the torch call will say so
    name = getattr(g, "group_name", None)
    if name:
        return str(name)
    return "ranks:" + ",".join(map(str, dist.get_process_group_ranks(g)))


class ArrivalBoard:
    """This rank's per-group collective counts, published to the store by a daemon thread."""

    def __init__(self) -> None:
        self._world: Any = None
        self._names: dict[int, str] = {}
        self._counts: dict[str, tuple[int, str, str | None]] = {}
        self._version = 0
        self._store: Any = None
        self._rank = -1
        self._started = False
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._exit_hook = False

    def enter(self, op: str, group: Any, label: str | None) -> Arrival:
        """Count one collective on ``group`` (called by ``comm`` before issuing it)."""
        if dist.GroupMember.WORLD is not self._world:
            self._reset()  # first use, or a new default process group: start over
        key = id(group)
        name = self._names.get(key)
        if name is None:
            name = self._names[key] = _group_name(group)
        seq = self._counts[name][0] + 1 if name in self._counts else 1
        self._counts[name] = (seq, op, label)
        self._version += 1
        if not self._started:
            self._start()
        return Arrival(name, seq, op, label)

    def _reset(self) -> None:
        self.stop(join=False)
        self._world = dist.GroupMember.WORLD
        self._names.clear()
        self._counts.clear()
        self._store, self._started, self._stop = None, False, threading.Event()

    def _start(self) -> None:
        """Start publishing (once per process group; lazily, so that a process group made
        outside slipstream is covered too). Nothing to do for a world of one."""
        if not dist.is_initialized():
            return
        self._started = True
        if dist.get_world_size() == 1:
            return
        try:
            store = dist.distributed_c10d._get_default_store()
        except (RuntimeError, ValueError, AttributeError) as err:
            logger.debug("arrival records off: no default store (%s)", err)
            return
        self._store = dist.PrefixStore(_PREFIX, store)
        self._rank = dist.get_rank()
        self._thread = threading.Thread(
            target=self._run, args=(self._stop,), name="slipstream-arrivals", daemon=True
        )
        self.publish()  # now, so that even a rank that stalls right away has a record
        self._thread.start()
        if not self._exit_hook:
            # Stop before interpreter finalization: a daemon thread inside a store call then
            # would abort the process when it comes back.
            atexit.register(self.stop)
            self._exit_hook = True

    def _run(self, stop: threading.Event) -> None:
        published = -1
        while not stop.wait(_PUBLISH_INTERVAL_S):
            if self._version != published:
                published = self._version
                if not self.publish():
                    return

    def publish(self) -> bool:
        """Write this rank's counts to the store now; False if the store is gone."""
        if self._store is None:
            return False
        who = f"host {socket.gethostname()}, local rank {os.environ.get('LOCAL_RANK', '?')}"
        groups = {k: list(v) for k, v in dict(self._counts).items()}
        record = json.dumps(
            {"who": f"{who}, pid {os.getpid()}", "groups": groups, "at": time.time()}
        )
        try:
            self._store.set(str(self._rank), record)
        except (RuntimeError, OSError) as err:  # the job's store went away: stop quietly
            logger.debug("arrival records stopped: %s", err)
            return False
        return True

    def stop(self, join: bool = True) -> None:
        """Stop the publishing thread (at exit, or when the process group is replaced)."""
        self._stop.set()
        thread = self._thread
        if join and thread is not None and thread.is_alive():
            thread.join(_STOP_JOIN_S)
            if thread.is_alive():  # a daemon: finalization ends it; say what it still does
                logger.warning(
                    "the arrival-record thread was still inside a store call %.0f s after it was "
                    "asked to stop (the job's store is slow or gone); exiting without it",
                    _STOP_JOIN_S,
                )

    def peers(self, arrival: Arrival, ranks: list[int]) -> list[PeerState] | None:
        """The records of ``ranks`` for ``arrival``'s group, after one publishing interval
        (peers that arrived just before us publish within it); None without a store."""
        if self._store is None or not self.publish():
            return None
        time.sleep(_PUBLISH_INTERVAL_S * 1.5)
        out = []
        for rank in ranks:
            record: dict[str, Any] = {}
            try:
                if self._store.check([str(rank)]):  # get() would wait for a missing key
                    record = json.loads(self._store.get(str(rank)))
            except (RuntimeError, OSError, ValueError):
                return None
            seq, op, label = record.get("groups", {}).get(arrival.group) or (0, None, None)
            at = record.get("at")
            age = max(0.0, time.time() - at) if isinstance(at, int | float) else None
            state = PeerState(rank, int(seq), op, label, bool(record), record.get("who", ""), age)
            out.append(state)
        return out


def _ranks(states: list[PeerState]) -> str:
    ranks = [s.rank for s in states]
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def _last_seen(state: PeerState) -> str:
    who = f"rank {state.rank}" + (f" ({state.where})" if state.where else "")
    if not state.published:
        return f"{who} published no arrival record (stalled before its first collective?)"
    if state.seq == 0:
        return f"{who} entered no collective on this group yet"
    label = f" {state.label!r}" if state.label else ""
    age = f" (its record was {state.age_s:.1f} s old)" if state.age_s is not None else ""
    return f"{who} was last seen entering #{state.seq} {state.op}{label}{age}"


def describe_peers(arrival: Arrival, peers: list[PeerState] | None) -> str:
    """Which peers did not arrive at ``arrival`` (and where they are), for an error message."""
    if peers is None:
        return "which ranks did not arrive is unknown (no arrival records in the job's store)"
    behind = [p for p in peers if p.seq < arrival.seq]
    ahead = [p for p in peers if p.seq > arrival.seq]
    parts = []
    if behind:
        seen = "; ".join(_last_seen(p) for p in behind[:8])
        parts.append(f"{_ranks(behind)} did not arrive ({seen})")
    if ahead:
        parts.append(
            f"{_ranks(ahead)} already went past it (to #{max(p.seq for p in ahead)}): the "
            "ranks issued different collectives on this group"
        )
    if not parts:
        return (
            "every rank of the group arrived at it (one is much slower inside it, or the "
            "network failed)"
        )
    return "; ".join(parts)


arrivals = ArrivalBoard()
