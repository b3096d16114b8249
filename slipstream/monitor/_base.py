"""DeepSpeed's ``Monitor`` base class and the one-backend monitors built on it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any

from slipstream._logging import global_rank
from slipstream.profiling.monitor import Backend, scalar_events

__all__ = ["Monitor", "SingleMonitor"]


class Monitor(ABC):
    """DeepSpeed's abstract monitor: built from its config block, takes
    ``write_events([(name, value, step), ...])``."""

    @abstractmethod
    def __init__(self, monitor_config: Any) -> None:
        self.monitor_config = monitor_config

    @abstractmethod
    def write_events(self, event_list: Iterable[Any]) -> None:
        """Write ``(name, value, step)`` events."""


class SingleMonitor(Monitor):
    """One monitor backend, DeepSpeed's way: ``enabled`` is the block's ``enabled``; the
    backend (and its library) exists on global rank 0 only when enabled, and
    ``write_events`` writes there, synchronously, while ``enabled`` stays true."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.enabled: bool = config.enabled
        self.backend: Backend | None = None
        if self.enabled and global_rank() == 0:
            self.backend = self.make_backend(config)

    @abstractmethod
    def make_backend(self, config: Any) -> Backend:
        """The slipstream backend that writes for this monitor."""

    def write_events(self, event_list: Iterable[Any]) -> None:
        """Write the events now (rank 0, enabled). Each is ``(name, value, step)``: a name, a
        real number or one-element tensor, an integer step; anything else is a
        ``ValueError`` naming the event."""
        if self.enabled and self.backend is not None:
            self.backend.write(scalar_events(event_list))
