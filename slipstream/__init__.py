"""slipstream: train and serve large models fast, with little memory, at any scale.

``import slipstream as deepspeed`` keeps DeepSpeed scripts working: ``initialize``,
``init_distributed``, ``comm``, ``checkpointing`` (activation checkpointing),
``add_config_arguments``, ``init_inference`` (the inference engine), ``slipstream.pipe`` and
``slipstream.PipelineModule`` (pipeline modules), ``accelerator`` and ``get_accelerator``,
``ops.adam``, ``utils``, ``runtime.utils``, ``runtime.lr_schedules``, ``OnDevice`` and the
engine's methods.
With ``SLIPSTREAM_AS_DEEPSPEED=1`` even ``import deepspeed`` is slipstream
(docs/compatibility.md).
"""

from __future__ import annotations

import argparse

from slipstream import accelerator, checkpointing, comm, compression, ops, pipe, rlhf, utils, zero
from slipstream.accelerator import get_accelerator
from slipstream.comm import init_distributed
from slipstream.config import ConfigError, SlipstreamConfig
from slipstream.inference import InferenceEngine, init_inference
from slipstream.pipe import PipelineModule

# As after `import deepspeed`, `deepspeed.runtime.utils` and `.lr_schedules` resolve.
from slipstream.runtime import lr_schedules as _lr_schedules  # noqa: F401
from slipstream.runtime import utils as _runtime_utils  # noqa: F401
from slipstream.runtime.engine import Engine
from slipstream.runtime.initialize import initialize
from slipstream.utils import OnDevice, log_dist, logger
from slipstream.version import DEEPSPEED_VERSION, __version__

DeepSpeedEngine = Engine
DeepSpeedConfig = SlipstreamConfig

__version_major__, __version_minor__, __version_patch__ = (
    int(x) for x in __version__.split(".")[:3]
)

__all__ = [
    "DEEPSPEED_VERSION",
    "ConfigError",
    "DeepSpeedConfig",
    "DeepSpeedEngine",
    "Engine",
    "InferenceEngine",
    "OnDevice",
    "PipelineModule",
    "SlipstreamConfig",
    "__version__",
    "accelerator",
    "add_config_arguments",
    "checkpointing",
    "comm",
    "compression",
    "get_accelerator",
    "init_distributed",
    "init_inference",
    "initialize",
    "log_dist",
    "logger",
    "ops",
    "pipe",
    "rlhf",
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
