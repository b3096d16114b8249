"""DeepSpeed engine attributes that scripts read, kept out of ``engine.py``.

``DeepSpeedEngineAttributes`` is mixed into ``Engine``: attribute look-ups that the engine does
not answer fall through to the wrapped module (as DeepSpeed's engine does, so
``engine.config`` of a Hugging Face model or ``engine.generate`` work), plus the small
introspection surface DeepSpeed scripts use (``tput_timer``, ``world_size``,
``mp_world_size``, ``steps_per_print()``, ``wall_clock_breakdown()``,
``zero_optimization_partition_gradients()``, ``data_parallel_group``, ``save_fp16_model``,
``empty_partition_cache``, the ZeRO-3 consolidated state dict Accelerate saves). Nothing here
changes training.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from slipstream.distributed import comm
from slipstream.distributed.mesh import dp_group
from slipstream.runtime._observer import EngineObserver

if TYPE_CHECKING:
    from slipstream.config.schema import SlipstreamConfig

__all__ = ["DEEPSPEED_STEPS_PER_PRINT", "DeepSpeedEngineAttributes", "ThroughputTimer"]

DEEPSPEED_STEPS_PER_PRINT = 10
"""What DeepSpeed's ``steps_per_print()`` returns when the config has no such key."""


class ThroughputTimer(EngineObserver):
    """DeepSpeed's ``engine.tput_timer``: samples per second over optimizer steps, leaving out
    the first ``start_step`` steps (warm-up, compilation, allocator growth).

    One of the engine's observers: it ticks once per optimizer step.
    """

    def __init__(self, batch_size: int, start_step: int = 2) -> None:
        self.batch_size = batch_size
        self.start_step = start_step
        self.global_step_count = 0
        self.epoch_count = 0
        self.total_elapsed_time = 0.0
        self.step_elapsed_time = 0.0
        self._last: float | None = None

    def tick(self) -> None:
        """Mark the end of an optimizer step."""
        now = time.perf_counter()
        self.global_step_count += 1
        if self._last is not None and self.global_step_count > self.start_step:
            self.step_elapsed_time = now - self._last
            self.total_elapsed_time += self.step_elapsed_time
        self._last = now

    def on_step(self, engine: Any) -> None:
        self.tick()

    def update_epoch_count(self) -> None:
        """Count a finished epoch (DeepSpeed-Chat calls it after each)."""
        self.epoch_count += 1

    def avg_samples_per_sec(self) -> float:
        """Mean samples/s after the warm-up steps; ``-inf`` before any step was timed (as
        DeepSpeed's)."""
        timed = self.global_step_count - self.start_step
        if timed <= 0 or self.total_elapsed_time <= 0:
            return float("-inf")
        return self.batch_size * timed / self.total_elapsed_time


class DeepSpeedEngineAttributes:
    """Mixin for ``Engine`` (an ``nn.Module`` holding the model as ``self.module``)."""

    if TYPE_CHECKING:  # what the mixin uses of Engine
        mesh: Any
        config: SlipstreamConfig
        optimizer: Any

        def train_batch_size(self) -> int: ...
        def zero_optimization_stage(self) -> int: ...
        def save_16bit_model(
            self, save_dir: str, save_filename: str = ..., exclude_frozen_parameters: bool = ...
        ) -> bool: ...

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal look-up failed: nn.Module's registries, then the model.
        try:
            return nn.Module.__getattr__(self, name)  # type: ignore[arg-type]
        except AttributeError:
            pass
        modules = self.__dict__.get("_modules", {})
        inner = modules.get("module")
        if inner is not None and not name.startswith("__"):
            try:
                return getattr(inner, name)
            except AttributeError:
                pass
        raise AttributeError(
            f"'{type(self).__name__}' object has no attribute '{name}', and neither has the "
            f"wrapped module ({type(inner).__name__})"
        )

    @property
    def tput_timer(self) -> ThroughputTimer:
        timer = self.__dict__.get("_tput_timer")
        if timer is None:
            timer = ThroughputTimer(self.train_batch_size())
            self.__dict__["_tput_timer"] = timer
        return timer

    @property
    def world_size(self) -> int:
        """All ranks of the job (DeepSpeed's ``engine.world_size``)."""
        return comm.get_world_size()

    @property
    def mp_world_size(self) -> int:
        """Tensor-parallel (model-parallel) ranks: DeepSpeed's ``mpu`` model-parallel size."""
        names = self.mesh.mesh_dim_names or ()
        return self.mesh["tp"].size() if "tp" in names else 1

    @property
    def data_parallel_group(self) -> Any:
        """The process group over which gradients are averaged."""
        return dp_group(self.mesh)

    def steps_per_print(self) -> int:
        """The config's ``steps_per_print``, else DeepSpeed's default 10 (slipstream logs no
        step lines unless the key is set)."""
        return self.config.steps_per_print or DEEPSPEED_STEPS_PER_PRINT

    def wall_clock_breakdown(self) -> bool:
        return self.config.wall_clock_breakdown

    def zero_optimization_partition_gradients(self) -> bool:
        """Whether gradients are partitioned over the data-parallel ranks (stage 2 or 3)."""
        return self.zero_optimization_stage() >= 2

    def save_fp16_model(
        self,
        save_dir: str,
        save_filename: str = "pytorch_model.bin",
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """DeepSpeed's old name of ``save_16bit_model``."""
        return self.save_16bit_model(save_dir, save_filename, exclude_frozen_parameters)

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """``zero_optimization.stage3_gather_16bit_weights_on_model_save`` (Accelerate asks
        before saving a ZeRO-3 model)."""
        return self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save

    def _zero3_consolidated_16bit_state_dict(
        self, exclude_frozen_parameters: bool = False
    ) -> dict[str, torch.Tensor] | None:
        """DeepSpeed's: the full state dict of a ZeRO-3 model on the CPU of rank 0 (None on
        the other ranks), in the parameters' dtype; tied parameters share one tensor.

        Every rank must call it. Parameters are gathered one module at a time, so rank 0
        holds the CPU copy plus one module's parameters (Accelerate and the Hugging Face
        Trainer save ZeRO-3 models through this).
        """
        if self.zero_optimization_stage() != 3:
            raise ValueError(
                "_zero3_consolidated_16bit_state_dict() requires ZeRO stage 3: at stage "
                f"{self.zero_optimization_stage()} use engine.module.state_dict()"
            )
        from slipstream.zero import GatheredParameters

        rank0 = comm.get_rank() == 0
        out: dict[str, torch.Tensor] = {}
        seen: dict[int, str] = {}
        for prefix, module in self.module.named_modules():
            dot = f"{prefix}." if prefix else ""
            with GatheredParameters(list(module.parameters(recurse=False))):
                if not rank0:
                    continue
                for name, param in module.named_parameters(recurse=False):
                    if exclude_frozen_parameters and not param.requires_grad:
                        continue
                    key = seen.setdefault(id(param), dot + name)
                    out[dot + name] = out[key] if key in out else param.detach().cpu().clone()
                for name, buf in module.named_buffers(recurse=False):
                    if name not in module._non_persistent_buffers_set:
                        out[dot + name] = buf.detach().cpu().clone()
        return out if rank0 else None

    def empty_partition_cache(self) -> None:
        """ZeRO-3: release every gathered parameter now (e.g. before generation outside
        the engine); a no-op at stages 0-2."""
        if self.optimizer is not None:
            self.optimizer.release_gathered()
