"""Observability: training monitors (TensorBoard, CSV, W&B, Comet)."""

from slipstream.profiling.monitor import MonitorMaster

__all__ = ["MonitorMaster"]
