"""When each compression technique turns on (``deepspeed.compression.scheduler``).

The scheduler counts applied optimizer steps (``training_steps``; a skipped fp16-overflow step
does not count) and, at each count, switches on every technique whose ``schedule_offset`` is
reached (sparse pruning only inside ``[schedule_offset, schedule_offset_end]``) by setting the
layer's DeepSpeed switch attribute. Switches only ever turn on. The engine drives it as
DeepSpeed's does: a check before the first forward, and one step per applied optimizer step.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from slipstream._logging import log_rank0
from slipstream.compression.helper import recursive_getattr
from slipstream.compression.layers import is_compressible
from slipstream.config.compression import CompressionConfig

__all__ = ["CompressionScheduler", "compression_scheduler", "modules_matching"]

SWITCHES = {
    "weight_quantization": "weight_quantization_enabled",
    "activation_quantization": "activation_quantization_enabled",
    "sparse_pruning": "sparse_pruning_enabled",
    "head_pruning": "head_pruning_enabled",
    "row_pruning": "row_pruning_enabled",
    "channel_pruning": "channel_pruning_enabled",
}
"""Technique -> the layer attribute that turns it on (DeepSpeed's names)."""


def modules_matching(
    model: nn.Module, pattern: str, taken: set[str], *, group: str, strict: bool
) -> list[str]:
    """Names of compressible modules of ``model`` where ``re.search(pattern, name)`` finds a
    match and that no earlier group of the technique took (``taken`` is updated).

    Raises:
        ValueError: ``strict`` and a matching module already belongs to another group.
    """
    names = []
    for name, module in model.named_modules():
        if not is_compressible(module) or re.search(pattern, name) is None:
            continue
        if name in taken:
            if strict:
                raise ValueError(
                    f"compression_training group {group!r}: module {name!r} (pattern "
                    f"{pattern!r}) is already in another group of the same technique; a "
                    "module may sit in one group per technique"
                )
            continue
        taken.add(name)
        names.append(name)
    return names


class CompressionScheduler:
    """Turns techniques on at their schedule offsets (DeepSpeed's ``compression_scheduler``)."""

    def __init__(self, model: nn.Module, config: CompressionConfig) -> None:
        self.model = model
        self.config = config
        self.training_steps = 0
        self.weight_quantization_enabled = False
        self._modules: dict[str, list[str]] = {}
        for key, tech in config.techniques().items():
            taken: set[str] = set()
            names: list[str] = []
            for group, spec in (tech.different_groups or {}).items():
                for pattern in spec.modules:
                    names += modules_matching(model, pattern, taken, group=group, strict=False)
            self._modules[key] = names
        self._announced: set[str] = set()

    def _due(self, key: str) -> bool:
        shared = self.config.techniques()[key].shared_parameters  # type: ignore[attr-defined]
        if self.training_steps < shared.schedule_offset:
            return False
        if key == "sparse_pruning":
            end = shared.schedule_offset_end
            return self.training_steps <= (shared.schedule_offset if end is None else end)
        return True

    def check_all_modules(self) -> None:
        """Switch on every enabled technique whose offset the step count has reached."""
        for key, tech in self.config.techniques().items():
            if not tech.enabled or not self._due(key):
                continue
            for name in self._modules[key]:
                setattr(recursive_getattr(self.model, name), SWITCHES[key], True)
            if key not in self._announced:
                self._announced.add(key)
                log_rank0(f"{key} is enabled at step {self.training_steps}")
                if key == "weight_quantization":
                    self.weight_quantization_enabled = True

    def step(self, step_zero_check: bool = False) -> None:
        """Count one applied optimizer step (not for ``step_zero_check``), then check."""
        if not step_zero_check:
            self.training_steps += 1
        self.check_all_modules()

    def state_dict(self) -> dict[str, Any]:
        return {"training_steps": self.training_steps}


compression_scheduler = CompressionScheduler
"""DeepSpeed's class name."""
