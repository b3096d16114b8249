"""slipstream: train and serve large models fast, with little memory, at any scale.

``import slipstream as deepspeed`` keeps DeepSpeed scripts working: ``initialize``,
``init_distributed``, ``comm``, ``checkpointing`` (activation checkpointing),
``add_config_arguments``, ``slipstream.pipe`` and ``slipstream.PipelineModule`` (pipeline
modules) and the engine's methods.
"""

from __future__ import annotations

import argparse

from slipstream import checkpointing, comm, pipe, utils, zero
from slipstream.config import ConfigError, SlipstreamConfig
from slipstream.distributed.comm import init_distributed
from slipstream.pipe import PipelineModule
from slipstream.runtime.engine import Engine
from slipstream.runtime.initialize import initialize
from slipstream.version import __version__

DeepSpeedEngine = Engine
DeepSpeedConfig = SlipstreamConfig

__version_major__, __version_minor__, __version_patch__ = (
    int(x) for x in __version__.split(".")[:3]
)

__all__ = [
    "ConfigError",
    "DeepSpeedConfig",
    "DeepSpeedEngine",
    "Engine",
    "PipelineModule",
    "SlipstreamConfig",
    "__version__",
    "add_config_arguments",
    "checkpointing",
    "comm",
    "init_distributed",
    "initialize",
    "pipe",
    "utils",
    "zero",
]


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's ``--deepspeed`` and ``--deepspeed_config`` arguments to ``parser``."""
    group = parser.add_argument_group("slipstream", "slipstream (DeepSpeed-compatible) options")
    group.add_argument(
        "--deepspeed",
        default=False,
        action="store_true",
        help="enable the engine (compatibility flag)",
    )
    group.add_argument(
        "--deepspeed_config", default=None, type=str, help="path to the JSON/HJSON config"
    )
    return parser
