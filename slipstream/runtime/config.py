"""``deepspeed.runtime.config``: DeepSpeed's config object, its error and its name constants.

``DeepSpeedConfig(config, mpu=None)`` takes what DeepSpeed's takes (a dict, a JSON/HJSON path
or a base64 string), parses it once with slipstream's typed loader (so unknown keys and bad
values are errors naming the key) and answers DeepSpeed's attribute names:
``train_batch_size``/``train_micro_batch_size_per_gpu``/``gradient_accumulation_steps``
resolved for the data-parallel world (the process group's, or 1 before one exists),
``zero_config`` (``DeepSpeedZeroConfig``), ``zero_optimization_stage``, ``zero_enabled``,
``fp16_enabled``, ``bfloat16_enabled``, ``optimizer_name``/``optimizer_params``,
``scheduler_name``/``scheduler_params``, ``gradient_clipping``; any other typed field by its
name (``config.steps_per_print``). ``_param_dict`` is the dict as given.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from slipstream._logging import logger
from slipstream.config import ConfigError, parse_config
from slipstream.config.loader import load_config
from slipstream.config.monitor import DeepSpeedMonitorConfig
from slipstream.config.schema import GRADIENT_CLIPPING_DEFAULT, SlipstreamConfig
from slipstream.distributed import comm
from slipstream.zero.config import DeepSpeedZeroConfig

__all__ = [
    "ADAGRAD_OPTIMIZER",
    "ADAMW_OPTIMIZER",
    "ADAM_OPTIMIZER",
    "DEEPSPEED_OPTIMIZERS",
    "LAMB_OPTIMIZER",
    "LION_OPTIMIZER",
    "MUADAM_OPTIMIZER",
    "MUSGD_OPTIMIZER",
    "ONEBIT_ADAM_OPTIMIZER",
    "ONEBIT_LAMB_OPTIMIZER",
    "SGD_OPTIMIZER",
    "TORCH_ADAM_PARAM",
    "ZERO_ONE_ADAM_OPTIMIZER",
    "DeepSpeedConfig",
    "DeepSpeedConfigError",
    "get_gradient_clipping",
]

DeepSpeedConfigError = ConfigError
"""DeepSpeed's config error: slipstream's ``ConfigError`` (a ``ValueError``)."""

ADAGRAD_OPTIMIZER = "adagrad"
ADAM_OPTIMIZER = "adam"
ADAMW_OPTIMIZER = "adamw"
LAMB_OPTIMIZER = "lamb"
ONEBIT_ADAM_OPTIMIZER = "onebitadam"
ZERO_ONE_ADAM_OPTIMIZER = "zerooneadam"
ONEBIT_LAMB_OPTIMIZER = "onebitlamb"
MUADAM_OPTIMIZER = "muadam"
MUADAMW_OPTIMIZER = "muadamw"
MUSGD_OPTIMIZER = "musgd"
LION_OPTIMIZER = "lion"
SGD_OPTIMIZER = "sgd"
DEEPSPEED_OPTIMIZERS = [
    ADAGRAD_OPTIMIZER,
    ADAM_OPTIMIZER,
    ADAMW_OPTIMIZER,
    LAMB_OPTIMIZER,
    ONEBIT_ADAM_OPTIMIZER,
    ONEBIT_LAMB_OPTIMIZER,
    ZERO_ONE_ADAM_OPTIMIZER,
    MUADAM_OPTIMIZER,
    MUADAMW_OPTIMIZER,
    MUSGD_OPTIMIZER,
    LION_OPTIMIZER,
    SGD_OPTIMIZER,
]
"""The ``optimizer.type`` names DeepSpeed builds (lower case)."""
TORCH_ADAM_PARAM = "torch_adam"


def get_gradient_clipping(param_dict: Mapping[str, Any]) -> float:
    """``gradient_clipping`` of a raw config dict, DeepSpeed's default (1.0) when absent."""
    return float(param_dict.get("gradient_clipping", GRADIENT_CLIPPING_DEFAULT))


class DeepSpeedConfig:
    """A parsed config under DeepSpeed's attribute names (see the module docstring)."""

    def __init__(
        self,
        config: Mapping[str, Any] | str | os.PathLike[str],
        mpu: Any = None,
        mesh_device: Any = None,
    ) -> None:
        self._param_dict: dict[str, Any] = load_config(config)
        if mpu is not None:
            dp = int(mpu.get_data_parallel_world_size())
        elif comm.is_initialized():
            dp = comm.get_world_size()
        else:
            dp = 1
        self.world_size = dp
        self._config: SlipstreamConfig = parse_config(self._param_dict, dp_world_size=dp)
        self.zero_config = DeepSpeedZeroConfig(**self._param_dict.get("zero_optimization", {}))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_config", "_param_dict"):
            raise AttributeError(name)
        return getattr(self._config, name)

    @property
    def train_batch_size(self) -> int | None:
        return self._config.train_batch_size

    @property
    def train_micro_batch_size_per_gpu(self) -> int | None:
        return self._config.train_micro_batch_size_per_gpu

    @property
    def gradient_accumulation_steps(self) -> int | None:
        return self._config.gradient_accumulation_steps

    @property
    def zero_optimization_stage(self) -> int:
        return self._config.zero_optimization.stage

    @property
    def zero_enabled(self) -> bool:
        return self.zero_optimization_stage > 0

    @property
    def fp16_enabled(self) -> bool:
        return bool(self._config.fp16.enabled)

    @property
    def bfloat16_enabled(self) -> bool:
        return bool(self._config.bf16.enabled)

    @property
    def optimizer_name(self) -> str | None:
        opt = self._config.optimizer
        return None if opt is None else opt.type.lower()

    @property
    def optimizer_params(self) -> dict[str, Any] | None:
        opt = self._config.optimizer
        return None if opt is None else dict(opt.params)

    @property
    def scheduler_name(self) -> str | None:
        sched = self._config.scheduler
        return None if sched is None else sched.type

    @property
    def scheduler_params(self) -> dict[str, Any] | None:
        sched = self._config.scheduler
        return None if sched is None else dict(sched.params)

    @property
    def monitor_config(self) -> DeepSpeedMonitorConfig:
        """The monitor blocks (``deepspeed.monitor.monitor.MonitorMaster``'s argument)."""
        c = self._config
        return DeepSpeedMonitorConfig(
            tensorboard=c.tensorboard, comet=c.comet, wandb=c.wandb, csv_monitor=c.csv_monitor
        )

    @property
    def gradient_clipping(self) -> float:
        return self._config.gradient_clipping

    def print(self, name: str) -> None:
        """DeepSpeed prints the config; slipstream logs it (library code does not print)."""
        logger.info("%s: %s", name, self._config.model_dump())
