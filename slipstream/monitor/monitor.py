"""``deepspeed.monitor.monitor``: ``Monitor`` and ``MonitorMaster``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from slipstream._logging import global_rank
from slipstream.config.monitor import DeepSpeedMonitorConfig
from slipstream.monitor._base import Monitor
from slipstream.monitor.comet import CometMonitor
from slipstream.monitor.csv_monitor import csvMonitor
from slipstream.monitor.tensorboard import TensorBoardMonitor
from slipstream.monitor.wandb import WandbMonitor

__all__ = [
    "CometMonitor",
    "Monitor",
    "MonitorMaster",
    "TensorBoardMonitor",
    "WandbMonitor",
    "csvMonitor",
]


class MonitorMaster(Monitor):
    """DeepSpeed's ``MonitorMaster(monitor_config)``: ``enabled`` (every rank) is whether any
    monitor is on; on global rank 0 it builds the enabled monitors and ``write_events`` writes
    to each of them, synchronously; elsewhere ``write_events`` does nothing.

    ``monitor_config`` is a ``DeepSpeedMonitorConfig`` (``get_monitor_config(ds_config)`` or
    ``DeepSpeedConfig(...).monitor_config``).
    """

    def __init__(self, monitor_config: DeepSpeedMonitorConfig) -> None:
        super().__init__(monitor_config)
        self.enabled = monitor_config.enabled
        self.tb_monitor: TensorBoardMonitor | None = None
        self.wandb_monitor: WandbMonitor | None = None
        self.csv_monitor: csvMonitor | None = None
        self.comet_monitor: CometMonitor | None = None
        if global_rank() != 0:
            return
        if monitor_config.tensorboard.enabled:
            self.tb_monitor = TensorBoardMonitor(monitor_config.tensorboard)
        if monitor_config.wandb.enabled:
            self.wandb_monitor = WandbMonitor(monitor_config.wandb)
        if monitor_config.csv_monitor.enabled:
            self.csv_monitor = csvMonitor(monitor_config.csv_monitor)
        if monitor_config.comet.enabled:
            self.comet_monitor = CometMonitor(monitor_config.comet)

    def write_events(self, event_list: Iterable[Any]) -> None:
        """Write ``(name, value, step)`` events to every monitor built here (rank 0)."""
        events = list(event_list)
        for monitor in (self.tb_monitor, self.wandb_monitor, self.csv_monitor, self.comet_monitor):
            if monitor is not None:
                monitor.write_events(events)
