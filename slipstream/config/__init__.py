"""Typed configuration and the DeepSpeed JSON loader."""

from slipstream.config._errors import ConfigError
from slipstream.config.auto import AutoContext
from slipstream.config.loader import load_config, parse_config, resolve_batch_sizes
from slipstream.config.precision import BF16Config, DataTypesConfig, FP16Config
from slipstream.config.schema import OptimizerConfig, SchedulerConfig, SlipstreamConfig
from slipstream.config.zero import OffloadConfig, ZeroConfig

__all__ = [
    "AutoContext",
    "BF16Config",
    "ConfigError",
    "DataTypesConfig",
    "FP16Config",
    "OffloadConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "SlipstreamConfig",
    "ZeroConfig",
    "load_config",
    "parse_config",
    "resolve_batch_sizes",
]
