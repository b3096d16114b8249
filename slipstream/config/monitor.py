"""Typed monitor blocks: ``tensorboard``, ``csv_monitor``, ``wandb`` and ``comet``.

Key names and defaults are DeepSpeed's (``deepspeed/monitor/config.py``), so a DeepSpeed
config that turns a monitor on runs unchanged; unknown keys are errors, as everywhere else.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field

from slipstream.config._base import StrictModel, validate_model

__all__ = [
    "CSVMonitorConfig",
    "CometConfig",
    "DeepSpeedMonitorConfig",
    "FlopsProfilerConfig",
    "TensorBoardConfig",
    "WandbConfig",
    "get_monitor_config",
]


class TensorBoardConfig(StrictModel):
    """``tensorboard``: scalar event files for TensorBoard (needs the ``tensorboard`` package)."""

    enabled: bool = False
    """Write events through ``torch.utils.tensorboard.SummaryWriter`` on rank 0."""
    output_path: str = ""
    """Directory that holds the job directory; "" is the current working directory."""
    job_name: str = Field("DeepSpeedJobName", min_length=1)
    """Subdirectory of ``output_path`` the event file goes to."""


class CSVMonitorConfig(StrictModel):
    """``csv_monitor``: one CSV file per scalar, ``output_path/job_name/<name>.csv``."""

    enabled: bool = False
    """Append every event to its scalar's CSV file on rank 0."""
    output_path: str = ""
    """Directory that holds the job directory; "" is the current working directory."""
    job_name: str = Field("DeepSpeedJobName", min_length=1)
    """Subdirectory of ``output_path`` the CSV files go to."""


class WandbConfig(StrictModel):
    """``wandb``: Weights & Biases (needs the ``wandb`` package; ``WANDB_MODE=offline`` works
    without network)."""

    enabled: bool = False
    """Start a W&B run on rank 0 and log every event to it."""
    group: str | None = None
    """W&B group that gathers related runs."""
    team: str | None = None
    """W&B entity (team or user) that owns the project."""
    project: str = "deepspeed"
    """W&B project name."""


class CometConfig(StrictModel):
    """``comet``: Comet ML experiment (needs the ``comet_ml`` package). Unset options fall back
    to Comet's own configuration (``.comet.config`` or ``COMET_*`` environment variables)."""

    enabled: bool = False
    """Start a Comet experiment on rank 0 and log events to it."""
    samples_log_interval: int = Field(100, ge=1)
    """Log a given scalar at most once every this many training samples."""
    project: str | None = None
    """Comet project name."""
    workspace: str | None = None
    """Comet workspace name."""
    api_key: str | None = None
    """Comet API key."""
    experiment_name: str | None = None
    """Display name of the experiment."""
    experiment_key: str | None = None
    """Key of an existing experiment to log to (32 to 50 alphanumeric characters)."""
    online: bool | None = None
    """False stores the experiment locally (offline mode); None is Comet's default (online)."""
    mode: Literal["get", "create", "get_or_create"] | None = None
    """Continue an existing experiment, always create one, or either (Comet's default)."""


class DeepSpeedMonitorConfig(StrictModel):
    """DeepSpeed's monitor block set (``deepspeed.monitor.config``): the four monitor blocks,
    each with its defaults when absent; ``enabled`` is true when any of them is."""

    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    """TensorBoard event files."""
    comet: CometConfig = Field(default_factory=CometConfig)
    """A Comet experiment."""
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    """A Weights & Biases run."""
    csv_monitor: CSVMonitorConfig = Field(default_factory=CSVMonitorConfig)
    """One CSV file per scalar."""

    @property
    def enabled(self) -> bool:
        """Whether any monitor is on."""
        return any(
            block.enabled for block in (self.tensorboard, self.comet, self.wandb, self.csv_monitor)
        )


def get_monitor_config(param_dict: Mapping[str, Any]) -> DeepSpeedMonitorConfig:
    """The monitor blocks of a raw config dict (DeepSpeed's function): unknown keys and bad
    values in them are ``ConfigError``s naming the key."""
    blocks = {
        key: param_dict[key]
        for key in ("tensorboard", "wandb", "csv_monitor", "comet")
        if key in param_dict
    }
    config: DeepSpeedMonitorConfig = validate_model(DeepSpeedMonitorConfig, blocks, "")
    return config


class FlopsProfilerConfig(StrictModel):
    """``flops_profiler``: profile one training step (``slipstream.profiling.flops``).

    Rank 0 counts the forward and backward of the first micro-batch of step ``profile_step``,
    prints the per-module table and the step's MFU, and from then on every step log line
    carries the MFU of the steps since the last one.
    """

    enabled: bool = False
    recompute_fwd_factor: float = Field(0.0, ge=0.0, le=1.0)
    """Share of the forward recomputed in backward (activation checkpointing: 1.0 for full
    recompute), added to the step's FLOPs."""
    profile_step: int = Field(1, ge=0)
    """The optimizer step to profile (counted from 0; 1 skips the first, warm-up step)."""
    module_depth: int = Field(-1, ge=-1)
    """Depth of the module tree printed; -1 prints all."""
    top_modules: int = Field(1, ge=1)
    """Modules listed per depth in the top-modules summary."""
    detailed: bool = True
    """Print the module tree (not only the summary)."""
    output_file: str | None = None
    """Write the profile to this file instead of stdout."""
