"""``deepspeed.monitor.config``: the typed monitor blocks under DeepSpeed's names."""

from __future__ import annotations

from slipstream.config.monitor import (
    CometConfig,
    CSVMonitorConfig,
    DeepSpeedMonitorConfig,
    TensorBoardConfig,
    WandbConfig,
    get_monitor_config,
)

CSVConfig = CSVMonitorConfig
"""DeepSpeed's name of the ``csv_monitor`` block."""

__all__ = [
    "CSVConfig",
    "CometConfig",
    "DeepSpeedMonitorConfig",
    "TensorBoardConfig",
    "WandbConfig",
    "get_monitor_config",
]
