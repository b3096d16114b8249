"""``deepspeed.monitor.csv_monitor``: ``csvMonitor``."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from slipstream.config.monitor import CSVMonitorConfig
from slipstream.monitor._base import SingleMonitor
from slipstream.profiling import monitor as backends

__all__ = ["csvMonitor"]


class csvMonitor(SingleMonitor):
    """One ``<name>.csv`` per scalar in ``output_path/job_name`` (rank 0, enabled), rows
    ``step,value`` under a ``step,<last part of the name>`` header; ``/`` and spaces in the
    name become ``_`` in the file name."""

    def __init__(self, csv_config: CSVMonitorConfig) -> None:
        self.output_path = csv_config.output_path
        self.job_name = csv_config.job_name
        self.filenames: list[str] = []
        """The file names (without ``.csv``) written so far, as DeepSpeed keeps them."""
        super().__init__(csv_config)
        self.log_dir = self.setup_log_dir()

    def make_backend(self, config: Any) -> backends.CSVMonitor:
        return backends.CSVMonitor(config)

    def setup_log_dir(self, base: str | None = None) -> str | None:
        """The directory the files go to (None where this monitor does not write). ``base``
        is DeepSpeed's directory for an ``output_path`` of None, which the typed config never
        holds; it is not used."""
        if self.backend is None:
            return None
        return os.path.join(self.output_path, self.job_name)

    def write_events(self, event_list: Iterable[Any]) -> None:
        events = list(event_list)
        super().write_events(events)
        if self.enabled and self.backend is not None:
            for event in events:
                stem = backends.csv_file_name(event[0])[: -len(".csv")]
                if stem not in self.filenames:
                    self.filenames.append(stem)
