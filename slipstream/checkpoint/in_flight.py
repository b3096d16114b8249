"""Asynchronous saves not committed yet, and what becomes of them at interpreter exit."""

from __future__ import annotations

import time
from typing import Any

from slipstream._logging import logger
from slipstream.distributed import comm

__all__ = ["IN_FLIGHT"]


class _InFlightSaves:
    """``checkpoint.async_save`` saves whose files are written but that no one committed
    yet, held strongly (the engine may be gone by exit). At exit each one's writer thread may
    finish its file (finalization would stop it inside a write) and a warning says the
    checkpoint was not committed. No commit at exit: it takes collectives, and a rank exiting
    on an error would pair them with its peers' training collectives."""

    def __init__(self) -> None:
        self.saves: list[Any] = []  # PendingSave
        self.hooked = False

    def add(self, pending: Any) -> None:
        self.saves.append(pending)
        if not self.hooked:
            comm.at_exit(self.at_exit)
            self.hooked = True

    def discard(self, pending: Any) -> None:
        self.saves = [p for p in self.saves if p is not pending]

    def at_exit(self, deadline: float | None) -> None:
        saves, self.saves = self.saves, []
        for pending in saves:
            thread = pending.thread
            if thread is not None:
                thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            still = thread is not None and thread.is_alive()
            if still or comm.get_rank() == 0:
                logger.warning(
                    "%s with checkpoint.async_save was never committed: the script ended "
                    "without engine.wait_for_checkpoint(), destroy() or another save/load%s; "
                    "'latest' still names the checkpoint before it (the next save removes the "
                    "temporary directory)",
                    pending.where,
                    " (and its shard file was still being written)" if still else "",
                )


IN_FLIGHT = _InFlightSaves()
