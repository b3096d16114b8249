"""Where an RLHF step's metrics go: the engine's monitors and, optionally, a JSON-lines file.

Every trainer (PPO, GRPO/RLOO, DPO) and ``slipstream chat``'s SFT and reward-model steps log
through :func:`log_step_metrics`: on rank 0 each numeric field becomes the scalar
``Train/<name>/<field>`` at the trainer's step, written to ``engine.monitor`` (the config's
TensorBoard, CSV, W&B and Comet blocks: reward, KL, lengths, losses next to the engine's own
loss and lr), and the whole row is appended to ``path`` when one is given. ``slipstream plot``
reads both: the CSV files as ``Train_<name>_<field>``, TensorBoard tags by name and a
JSON-lines file as ``<file stem>/<field>``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from slipstream.distributed import comm

__all__ = ["log_step_metrics"]


def log_step_metrics(
    engine: Any, name: str, metrics: Mapping[str, Any] | Any, path: Path | None = None
) -> None:
    """Log one step's ``metrics`` (a dict or a dataclass with a ``step`` field) on rank 0.

    Args:
        engine: the engine whose ``monitor`` gets the scalars, or None for the file only.
        name: the metric group (``ppo``, ``grpo``, ``dpo``, ``sft``, ``reward``).
        path: a JSON-lines file to append the row to (its directory is created).
    """
    if comm.get_rank() != 0:
        return
    row = dict(metrics) if isinstance(metrics, Mapping) else dataclasses.asdict(metrics)
    step = int(row["step"])
    if engine is not None:
        engine.monitor.write_events(
            [
                (f"Train/{name}/{key}", float(value), step)
                for key, value in row.items()
                if key != "step" and isinstance(value, int | float) and not isinstance(value, bool)
            ]
        )
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(json.dumps(row) + "\n")
