"""``deepspeed.monitor.tensorboard``: ``TensorBoardMonitor``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from slipstream.config.monitor import TensorBoardConfig
from slipstream.monitor._base import SingleMonitor
from slipstream.monitor.utils import check_tb_availability
from slipstream.profiling import monitor as backends

__all__ = ["TensorBoardMonitor"]


class TensorBoardMonitor(SingleMonitor):
    """Scalars to ``output_path/job_name`` through a ``SummaryWriter`` (rank 0, enabled);
    every ``write_events`` flushes them to the event file."""

    def __init__(self, tensorboard_config: TensorBoardConfig) -> None:
        self.output_path = tensorboard_config.output_path
        self.job_name = tensorboard_config.job_name
        super().__init__(tensorboard_config)

    def make_backend(self, config: Any) -> backends.TensorBoardMonitor:
        check_tb_availability()
        return backends.TensorBoardMonitor(config)

    @property
    def summary_writer(self) -> Any:
        """The ``SummaryWriter`` (None where this monitor does not write)."""
        return None if self.backend is None else self.backend.writer  # type: ignore[attr-defined]

    def get_summary_writer(self, base: str | None = None) -> Any:
        """The ``SummaryWriter``. ``base`` is DeepSpeed's directory for an ``output_path``
        of None, which the typed config never holds; it is not used."""
        return self.summary_writer

    def write_events(self, event_list: Iterable[Any], flush: bool = True) -> None:
        """Write the events; they are flushed to the file whatever ``flush`` says (the
        backend flushes every batch)."""
        super().write_events(event_list)

    def flush(self) -> None:
        if self.enabled and self.backend is not None:
            self.backend.flush()
