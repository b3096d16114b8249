"""The engine side of ``compression_training``: DeepSpeed's engine owns a compression
scheduler, checks it before the first forward and steps it after every applied optimizer
step. The runtime sits below this package, so this registers as an engine extension
(``slipstream.runtime.extensions``) that follows the engine's applied-step count after each
``engine.step()`` and, for paths that step the optimizer otherwise, before each forward: the
switches are always those DeepSpeed's scheduler has set by then (they only ever turn on,
each at a step count).
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from slipstream._logging import log_rank0
from slipstream.compression.helper import recursive_getattr
from slipstream.compression.layers import CompressedBatchNorm2d, is_compressible
from slipstream.compression.moq import MoQ
from slipstream.compression.scheduler import SWITCHES, CompressionScheduler
from slipstream.config import ConfigError
from slipstream.runtime.extensions import register_engine_extension

__all__ = ["attach_compression_scheduler_"]


def _applied_steps(engine: Any) -> int:
    return int(engine.global_steps) - int(engine.skipped_steps)


def _catch_up(engine: Any, scheduler: CompressionScheduler) -> None:
    while scheduler.training_steps < _applied_steps(engine):
        scheduler.step()


def _warn_unprepared(module: nn.Module, scheduler: CompressionScheduler) -> None:
    """An enabled technique whose modules were never prepared would train uncompressed."""
    for key, tech in scheduler.config.techniques().items():
        if not tech.enabled:
            continue
        names = scheduler._modules[key]
        prepared = [
            n
            for n in names
            if hasattr(recursive_getattr(module, n), SWITCHES[key])
            and not isinstance(recursive_getattr(module, n), CompressedBatchNorm2d)
        ]
        if not prepared:
            log_rank0(
                f"compression_training.{key} is enabled but no module of this engine's model "
                "is prepared for it (matched: %d): call deepspeed.compression.compress."
                "init_compression(model, config) before deepspeed.initialize, or this model "
                "trains uncompressed (as a DeepSpeed teacher engine does)",
                len([n for n in names if is_compressible(recursive_getattr(module, n))]),
                level=logging.WARNING,
            )


def _moq(engine: Any) -> MoQ | None:
    """DeepSpeed's MoQ quantizer when weight quantization runs outside the forward."""
    wq = engine.config.compression_training.weight_quantization
    if not wq.enabled or wq.shared_parameters.quantize_weight_in_forward:
        return None
    where = "compression_training.weight_quantization.shared_parameters"
    if not engine.config.fp16.enabled:
        raise ConfigError(
            f"config key '{where}.quantize_weight_in_forward' = false (MoQ) quantizes the fp16 "
            "weights after each step and needs fp16 (as in DeepSpeed): enable 'fp16', or set "
            "quantize_weight_in_forward to true"
        )
    if wq.shared_parameters.quantizer_kernel:
        raise ConfigError(
            f"config key '{where}.quantizer_kernel' = true: DeepSpeed's CUDA quantizer kernel "
            "is not built (slipstream compiles nothing); set it to false (the same arithmetic "
            "in PyTorch)"
        )
    return MoQ(engine.module, wq.shared_parameters)


def attach_compression_scheduler_(engine: Any) -> CompressionScheduler:
    """Give ``engine`` DeepSpeed's ``compression_scheduler`` and drive it from the engine's
    applied-step count: a step-zero check on the engine's first forwards, one scheduler step
    per applied optimizer step (caught up before any forward of the engine or its module)."""
    scheduler = CompressionScheduler(engine.module, engine.config.compression_training)
    object.__setattr__(engine, "compression_scheduler", scheduler)
    _warn_unprepared(engine.module, scheduler)
    moq = _moq(engine)
    object.__setattr__(engine, "quantizer", moq)  # DeepSpeed's name (None without MoQ)

    def before_engine_forward(_mod: nn.Module, _args: Any) -> None:
        if engine.global_steps == 0:
            scheduler.step(step_zero_check=True)
            if moq is not None and scheduler.weight_quantization_enabled:
                moq.quantize()  # as DeepSpeed: on every forward before the first step
        _catch_up(engine, scheduler)

    def before_module_forward(_mod: nn.Module, _args: Any) -> None:
        _catch_up(engine, scheduler)

    engine.register_forward_pre_hook(before_engine_forward)
    engine.module.register_forward_pre_hook(before_module_forward)
    engine_step = engine.step

    def step(*args: Any, **kwargs: Any) -> Any:
        before, quantizing = engine.global_steps, scheduler.weight_quantization_enabled
        try:
            out = engine_step(*args, **kwargs)
            stepped = engine.global_steps > before and engine.was_step_applied()
            if moq is not None and quantizing and stepped:  # not after an overflow (DeepSpeed)
                moq.quantize()
            return out
        finally:  # as DeepSpeed: the switches move with the step, not at the next forward
            _catch_up(engine, scheduler)

    object.__setattr__(engine, "step", step)
    return scheduler


register_engine_extension("compression_training", attach_compression_scheduler_)
