"""The engine's side of the ``flops_profiler`` block: profile one step, then report MFU.

Rank 0 counts the forward and backward of the first micro-batch of optimizer step
``profile_step`` (``slipstream.profiling.flops``), times its forward, backward and optimizer
step, and prints the module table with the step's FLOP/s and MFU. The FLOPs of that step are
then the estimate for every later step (same shapes assumed, as DeepSpeed's profiler does), so
each step log line carries the MFU of the steps since the previous line.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from slipstream.accelerator import get_accelerator
from slipstream.config.monitor import FlopsProfilerConfig
from slipstream.distributed import comm
from slipstream.profiling.flops import FlopsProfiler, device_peak_flops, training_flops
from slipstream.runtime._observer import EngineObserver

__all__ = ["StepProfiler"]


class StepProfiler(EngineObserver):
    """Drives a ``FlopsProfiler`` around the engine's phases (rank 0 only); an engine
    observer."""

    def __init__(
        self,
        config: FlopsProfilerConfig,
        module: nn.Module,
        device: torch.device,
        dtype: torch.dtype,
        accumulation: int,
    ) -> None:
        self.config = config
        self.device = device
        self.dtype = dtype
        self.accumulation = accumulation
        self.profiler = FlopsProfiler(module, recompute_fwd_factor=config.recompute_fwd_factor)
        self.flops_per_step: float | None = None
        """FLOPs of one optimizer step (all its micro-batches), known after the profile."""
        self._latency: dict[str, float] = {}
        self._active = False
        self._done = False

    @property
    def enabled_here(self) -> bool:
        return self.config.enabled and comm.get_rank() == 0

    @contextmanager
    def phase(self, engine: Any, name: str) -> Iterator[None]:
        """Wrap the engine's ``forward`` / ``backward`` / ``step``."""
        profile_now = engine.global_steps == self.config.profile_step
        if name == "forward" and not self._done and profile_now:
            if not self._active and "forward" not in self._latency:
                self.profiler.start_profile()
                self._active = True
        elif name == "backward" and self._active:
            self.profiler.backward_phase()
        timed = self._active or (
            name == "step" and "backward" in self._latency and "step" not in self._latency
        )
        if timed:
            _sync(self.device)
            start = time.perf_counter()
        try:
            yield
        finally:
            if timed:
                _sync(self.device)
                self._latency.setdefault(name, time.perf_counter() - start)
            if name == "backward" and self._active:
                self.profiler.stop_profile()
                self._active = False

    def on_step(self, engine: Any) -> None:
        self.after_step()

    def on_print(self, engine: Any, steps: int, seconds: float) -> str:
        return self.mfu_report(steps, seconds)

    def after_step(self) -> None:
        """After the profiled optimizer step: print the profile and fix ``flops_per_step``."""
        if self._done or "step" not in self._latency:
            return
        prof, cfg = self.profiler, self.config
        peak = device_peak_flops(self.device, self.dtype)
        prof.print_model_profile(
            profile_step=cfg.profile_step,
            module_depth=cfg.module_depth,
            top_modules=cfg.top_modules,
            detailed=cfg.detailed,
            output_file=cfg.output_file,
            step_latencies=self._latency,
            peak_flops=peak,
        )
        per_micro = training_flops(
            int(prof.get_total_flops()), prof.get_total_backward_flops(), cfg.recompute_fwd_factor
        )
        self.flops_per_step = per_micro * self.accumulation
        prof.end_profile()
        self._done = True

    def peak_flops(self) -> float | None:
        """The device's peak FLOP/s in the training dtype (None when unknown)."""
        return device_peak_flops(self.device, self.dtype)

    def mfu_report(self, steps: int, seconds: float) -> str:
        """``TFLOPS=... MFU=...`` for ``steps`` optimizer steps taking ``seconds``."""
        if self.flops_per_step is None or seconds <= 0:
            return ""
        rate = self.flops_per_step * steps / seconds
        peak = device_peak_flops(self.device, self.dtype)
        mfu = f" MFU={100 * rate / peak:.2f}%" if peak else ""
        return f" TFLOPS={rate / 1e12:.3f}{mfu}"


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        get_accelerator().synchronize(device.index)
