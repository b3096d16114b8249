"""Named fault-injection points between the filesystem steps of a save or load (for tests).

Checkpoint code calls ``point(name)`` after every step that changes the disk (and at a few
places of a load), so a test can stop a save *between* any two steps and check what a reader
then finds. Two ways to act at a point:

- In process: ``set_hook(fn)``; ``fn(name)`` runs at every point (record the points, raise,
  or copy the directory as a crash would leave it).
- Across processes: ``SLIPSTREAM_CHECKPOINT_FAULT="<action>:<point>[@<rank>]"``, where
  ``action`` is ``kill`` (SIGKILL: nothing runs after it, as in a power cut of one process)
  or ``raise`` (an ``OSError`` ENOSPC, what a full disk gives); ``@<rank>`` acts on that
  global rank only. ``benchmarks/faults.py`` lists the points and runs them.

Costs one dictionary lookup per point when unused.
"""

from __future__ import annotations

import errno
import os
import signal
from collections.abc import Callable

from slipstream.distributed import comm

__all__ = ["ENV", "point", "set_hook"]

ENV = "SLIPSTREAM_CHECKPOINT_FAULT"
_ACTIONS = ("kill", "raise")

_hook: Callable[[str], None] | None = None


def set_hook(hook: Callable[[str], None] | None) -> Callable[[str], None] | None:
    """Call ``hook(name)`` at every point from now on (``None``: stop); returns the old hook."""
    global _hook
    old, _hook = _hook, hook
    return old


def point(name: str) -> None:
    """A step of a save or load has just finished: run the hook and the ``ENV`` fault."""
    if _hook is not None:
        _hook(name)
    spec = os.environ.get(ENV)
    if spec:
        _inject(spec, name)


def _inject(spec: str, name: str) -> None:
    action, _, target = spec.partition(":")
    target, at, rank = target.rpartition("@") if "@" in target else (target, "", "")
    if action not in _ACTIONS or not target or (at and not rank.isdigit()):
        raise ValueError(
            f"{ENV}={spec!r} is not '<action>:<point>[@<rank>]' with action in {_ACTIONS} "
            "(e.g. 'kill:commit.exchanged' or 'raise:manifest.written@0'); unset it to save "
            "normally"
        )
    if target != name or (rank and int(rank) != comm.get_rank()):
        return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise OSError(errno.ENOSPC, f"No space left on device (injected at {name})")
