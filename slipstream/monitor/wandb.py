"""``deepspeed.monitor.wandb``: ``WandbMonitor``."""

from __future__ import annotations

from typing import Any

from slipstream.config.monitor import WandbConfig
from slipstream.monitor._base import SingleMonitor
from slipstream.monitor.utils import check_wandb_availability
from slipstream.profiling import monitor as backends

__all__ = ["WandbMonitor"]


class WandbMonitor(SingleMonitor):
    """A W&B run (``wandb.init(project, group, entity=team)``) on rank 0 when enabled; each
    step's events are one ``log`` row at that step."""

    def __init__(self, wandb_config: WandbConfig) -> None:
        self.group = wandb_config.group
        self.team = wandb_config.team
        self.project = wandb_config.project
        super().__init__(wandb_config)

    def make_backend(self, config: Any) -> backends.WandbMonitor:
        check_wandb_availability()
        return backends.WandbMonitor(config)

    def log(self, data: dict[str, Any], step: int | None = None, commit: bool | None = None) -> Any:
        """``wandb.log(data, step=step, commit=commit)`` on the run (rank 0, enabled)."""
        if self.enabled and self.backend is not None:
            return self.backend.run.log(data, step=step, commit=commit)  # type: ignore[attr-defined]
        return None
