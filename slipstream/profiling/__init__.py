"""Observability: training monitors (TensorBoard, CSV, W&B, Comet) and the FLOPs profiler."""

from slipstream.profiling.flops import FlopsProfiler, get_model_profile
from slipstream.profiling.monitor import MonitorMaster

__all__ = ["FlopsProfiler", "MonitorMaster", "get_model_profile"]
