"""``deepspeed.monitor.comet``: ``CometMonitor``."""

from __future__ import annotations

from typing import Any

from slipstream.config.monitor import CometConfig
from slipstream.monitor._base import SingleMonitor
from slipstream.monitor.utils import check_comet_availability
from slipstream.profiling import monitor as backends

__all__ = ["CometMonitor"]


class CometMonitor(SingleMonitor):
    """A Comet experiment (``comet_ml.start``) on rank 0 when enabled; each scalar is logged
    at most once per ``samples_log_interval`` samples (the step is the sample count)."""

    def __init__(self, comet_config: CometConfig) -> None:
        self._samples_log_interval = comet_config.samples_log_interval
        super().__init__(comet_config)

    def make_backend(self, config: Any) -> backends.CometMonitor:
        check_comet_availability()
        return backends.CometMonitor(config)

    @property
    def experiment(self) -> Any:
        """The Comet experiment (None where this monitor does not write)."""
        return None if self.backend is None else self.backend.experiment  # type: ignore[attr-defined]

    @property
    def samples_log_interval(self) -> int:
        return self._samples_log_interval
