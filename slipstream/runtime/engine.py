"""The training engine: sequences forward, backward and step. It holds no feature logic.

Gradient reduction, sharding, precision and clipping live in the ZeRO optimizer and its
reducer (``slipstream.zero``); the engine counts micro-steps, scales the loss and calls
them in order, with DeepSpeed's method names.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from slipstream._logging import log_rank0, logger
from slipstream.accelerator import get_accelerator
from slipstream.checkpoint.api import PendingSave, finish_save, load_checkpoint, save_checkpoint
from slipstream.config import ConfigError
from slipstream.config.schema import SlipstreamConfig
from slipstream.distributed import comm
from slipstream.distributed.timeouts import set_device_sync
from slipstream.precision import (
    NonFiniteGradientError,
    nonfinite_error_message,
    skipped_step_message,
)
from slipstream.profiling.monitor import MonitorMaster
from slipstream.runtime._deepspeed_engine import DeepSpeedEngineAttributes
from slipstream.runtime.compile import compile_module_
from slipstream.runtime.memory_report import MemoryBreakdown
from slipstream.runtime.step_profiler import StepProfiler
from slipstream.runtime.timers import StepTimers
from slipstream.zero import ZeroOptimizer, gathered_model, save_16bit_model

__all__ = ["DeepSpeedEngine", "Engine"]


class Engine(DeepSpeedEngineAttributes, nn.Module):
    """DeepSpeed-compatible engine around a module prepared by ``slipstream.initialize``.

    Use ``loss = engine(batch...)``, ``engine.backward(loss)``, ``engine.step()`` every
    micro-step; the optimizer steps only on the accumulation boundary. Attributes the engine
    lacks are looked up on the module (``DeepSpeedEngineAttributes``).
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: ZeroOptimizer | None,
        lr_scheduler: Any,
        config: SlipstreamConfig,
        mesh: Any,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.module = module
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.config = config
        self.mesh = mesh
        self.device = device
        self.training_dataloader: Any = None  # set by initialize when it builds one
        self._pending_save: PendingSave | None = None  # an async save not yet committed
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self._step_applied = False
        self._no_sync = False
        self._boundary_override: bool | None = None
        self._last_loss: torch.Tensor | None = None
        self._timers = StepTimers(config.wall_clock_breakdown, device)
        self.monitor = MonitorMaster.from_config(config)
        """DeepSpeed's ``engine.monitor``: ``write_events([(name, value, step), ...])`` sends
        user scalars to the configured monitors (rank 0 only)."""
        self._window_loss: torch.Tensor | None = None  # sum of this window's micro losses
        self._window_micro = 0
        self._last_print = time.perf_counter()
        self.flops_profiler: StepProfiler | None = None
        if config.flops_profiler.enabled and comm.get_rank() == 0:
            dtype = next((p.dtype for p in module.parameters()), torch.float32)
            self.flops_profiler = StepProfiler(
                config.flops_profiler, module, device, dtype, config.batch[2]
            )
        comm.comm_counters.verbose = config.comms_logger.verbose
        if not config.comms_logger.prof_all:
            comm.comm_counters.prof_ops = set(config.comms_logger.prof_ops)
        if config.comms_logger.enabled and device.type != "cpu":
            set_device_sync(get_accelerator().synchronize)  # per-collective times, as DeepSpeed's
        self._compiled = False
        self._started: float | None = None  # the first forward: the comm summary's time base
        self.memory: MemoryBreakdown | None = (
            MemoryBreakdown(device) if config.memory_breakdown else None
        )
        """``memory_breakdown``: memory at the phase boundaries (``initialize`` sets the
        estimator)."""

    # ---------------------------------------------------------------- introspection
    def train_batch_size(self) -> int:
        return self.config.batch[0]

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.batch[1]

    def gradient_accumulation_steps(self) -> int:
        return self.config.batch[2]

    def zero_optimization_stage(self) -> int:
        return self.config.zero_optimization.stage

    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16.enabled

    @property
    def local_rank(self) -> int:
        return comm.get_local_rank()

    @property
    def global_rank(self) -> int:
        return comm.get_rank()

    @property
    def dp_world_size(self) -> int:
        return self.config.batch[0] // (self.config.batch[1] * self.config.batch[2])

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self._require_optimizer().param_groups]

    def get_mom(self) -> list[Any]:
        return [
            g.get("betas", (g.get("momentum"),))[0] for g in self._require_optimizer().param_groups
        ]

    def get_global_grad_norm(self) -> float | None:
        """Global gradient norm (unscaled, before clipping) of the last optimizer step."""
        return None if self.optimizer is None else self.optimizer.global_grad_norm

    def was_step_applied(self) -> bool:
        """False when the last boundary step was skipped (inf/nan gradients, e.g. an fp16
        overflow or a non-finite loss on any rank)."""
        return self._step_applied

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary_override is not None:
            return self._boundary_override
        if not self.config.managed_gradient_accumulation:
            return True
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Force the boundary flag for the next step (DeepSpeed's manual control)."""
        self._boundary_override = is_boundary

    # --------------------------------------------------------------------- training
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self.config.fp16.enabled and self.config.fp16.auto_cast:
            inputs = tuple(_cast_floats(x, torch.float16) for x in inputs)
            kwargs = {k: _cast_floats(v, torch.float16) for k, v in kwargs.items()}
        if self._started is None:
            self._started = time.perf_counter()
        with self._timers.phase("forward"), self._profiled("forward"):
            return self.module(*inputs, **kwargs)

    @contextmanager
    def _profiled(self, phase: str) -> Iterator[None]:
        """The FLOPs profiler and the memory breakdown around one phase (when enabled)."""
        flops = self.flops_profiler
        with nullcontext() if flops is None else flops.phase(phase, self.global_steps):
            yield
        if self.memory is not None:
            self.memory.record(phase)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss as ``backward`` would differentiate it (1/accumulation x loss scale)."""
        opt = self._require_optimizer()
        factor = opt.loss_scale
        if self.config.managed_gradient_accumulation:
            factor /= self.gradient_accumulation_steps()
        opt.set_gradient_sync(self.is_gradient_accumulation_boundary() and not self._no_sync)
        return loss * factor if factor != 1.0 else loss

    def backward(
        self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True
    ) -> torch.Tensor:
        """Backpropagate ``loss / gradient_accumulation_steps`` (times the fp16 loss scale).

        Gradients are accumulated and, on the boundary (or every micro-step at stage 2),
        reduced across data-parallel ranks while backward runs.

        Returns, as DeepSpeed does, the loss divided by ``gradient_accumulation_steps``
        (undivided with ``scale_wrt_gas=False``), without the fp16 loss scale.
        """
        if loss.dim() != 0:
            raise ValueError(
                f"engine.backward expects a scalar loss, got shape {tuple(loss.shape)}: reduce "
                "it first (e.g. loss.mean())"
            )
        self._last_loss = loss.detach()
        if self.monitor.active:
            self._accumulate_loss(self._last_loss)
        scaled = self.scale(loss)
        if not scale_wrt_gas and self.config.managed_gradient_accumulation:
            scaled = scaled * self.gradient_accumulation_steps()
        with self._timers.phase("backward"), self._profiled("backward"):
            try:
                scaled.backward(retain_graph=retain_graph)
            except BaseException:
                self._require_optimizer().disarm_backward()
                raise
            self._require_optimizer().finish_backward()
        return loss / self.gradient_accumulation_steps() if scale_wrt_gas else loss

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """Advance one micro-step; on the boundary run the optimizer, scheduler and zero grads."""
        if self._no_sync:
            raise RuntimeError(
                "engine.step() inside engine.no_sync() is not allowed: leave the context first"
            )
        opt = self._require_optimizer()
        error: NonFiniteGradientError | None = None
        if self.is_gradient_accumulation_boundary():
            with self._timers.phase("step"), self._profiled("step"):
                self._step_applied = opt.step()
            # As DeepSpeed: a skipped step leaves the lr schedule alone but counts as a step.
            if self._step_applied:
                if self.lr_scheduler is not None:
                    self.lr_scheduler.step(**(lr_kwargs or {}))
            else:
                self.skipped_steps += 1
                error = self._report_skipped_step(opt)
            if self.flops_profiler is not None:
                self.flops_profiler.after_step(self.global_steps)
            self.global_steps += 1
            self.global_samples += self.train_batch_size()
            self._tick_throughput()
            if self.monitor.active:
                self._write_monitor()
            self._maybe_print()
        self.micro_steps += 1
        self._boundary_override = None
        opt.disarm_backward()  # a later pass not run by this engine leaves .grad alone
        if error is not None:
            raise error

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear accumulated gradients (parameters' ``.grad`` are always None here)."""
        if self.optimizer is not None:
            self.optimizer.zero_grad()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally without reducing them (stages 0 and 1)."""
        stage = self.zero_optimization_stage()
        if stage >= 2:
            raise RuntimeError(
                f"no_sync() is incompatible with ZeRO stage {stage}: gradients are partitioned "
                "(reduce-scattered) every micro-step. Use gradient_accumulation_steps instead, "
                "or ZeRO stage 0/1"
            )
        if self._no_sync:
            raise RuntimeError(
                "engine.no_sync() entered again inside engine.no_sync(): re-entry is not "
                "supported (as in DeepSpeed); leave the outer context first"
            )
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = False

    def save_16bit_model(
        self,
        save_dir: str,
        save_filename: str = "model.safetensors",
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """Write the full model in 16 bits (bf16, or fp16 when fp16 is enabled) as sharded
        safetensors with an index (Hugging Face layout); every rank must call it.

        ZeRO-3 units are gathered one at a time, so memory stays bounded by one unit.
        ``save_filename`` is accepted for DeepSpeed compatibility; only safetensors is written.
        """
        if exclude_frozen_parameters:
            raise ValueError("exclude_frozen_parameters=True is not supported yet: pass False")
        dtype = torch.float16 if self.fp16_enabled() else torch.bfloat16
        save_16bit_model(self.module, save_dir, dtype=dtype)
        return True

    def save_checkpoint(
        self,
        save_dir: str,
        tag: Any = None,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """Save a sharded checkpoint to ``save_dir/tag`` (default tag ``global_step{N}``).

        Every rank must call it; each writes only its shards. The directory appears
        atomically when complete; with ``save_latest`` the ``latest`` file names it. The
        checkpoint loads at any world size and ZeRO stage. ``client_state`` round-trips.
        """
        if save_dir is None:
            raise ValueError(
                "save_checkpoint(save_dir=None): pass the directory to write the checkpoint to"
            )
        if exclude_frozen_parameters:
            raise ValueError("exclude_frozen_parameters=True is not supported yet: pass False")
        self.wait_for_checkpoint()
        self._pending_save = save_checkpoint(self, save_dir, tag, client_state, save_latest)
        return True

    def load_checkpoint(
        self,
        load_dir: str,
        tag: Any = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
    ) -> tuple[str | None, dict[str, Any] | None]:
        """Load a checkpoint saved at any world size and stage; returns ``(path, client_state)``.

        ``(None, None)`` (with a log line) when ``tag`` is None and there is no ``latest``.
        """
        self.wait_for_checkpoint()
        return load_checkpoint(
            self,
            load_dir,
            tag,
            load_module_strict,
            load_optimizer_states,
            load_lr_scheduler_states,
            load_module_only,
        )

    def wait_for_checkpoint(self) -> None:
        """Commit an asynchronous ``save_checkpoint`` still in flight (every rank calls it)."""
        pending, self._pending_save = self._pending_save, None
        if pending is not None:
            finish_save(self, pending)

    def compile(
        self,
        backend: str | Any = "inductor",
        compile_kwargs: dict[str, Any] | None = None,
        schedule: Any = None,
        compiled_autograd_enabled: bool = False,
    ) -> None:
        """DeepSpeed's ``engine.compile``: ``torch.compile`` the model's repeated blocks in
        place (``slipstream.runtime.compile``); a second call is a no-op.

        Raises:
            ConfigError: a DeepCompile ``schedule`` or ``compiled_autograd_enabled`` (not
                implemented), or ``backend`` inside ``compile_kwargs``.
        """
        if schedule is not None or compiled_autograd_enabled:
            raise ConfigError(
                "engine.compile(schedule=..., compiled_autograd_enabled=True) belongs to "
                "DeepCompile, which slipstream does not implement; call engine.compile() "
                "with a backend and compile_kwargs only"
            )
        if self._compiled:
            return
        what = compile_module_(self.module, backend, compile_kwargs or {})
        self._compiled = True
        log_rank0("slipstream: compiled %s with torch.compile (backend=%s)", what, backend)

    @property
    def is_compiled(self) -> bool:
        """Whether :meth:`compile` ran."""
        return self._compiled

    @contextmanager
    def gathered_for_generation(self) -> Iterator[nn.Module]:
        """Gather ZeRO-3 parameters once for a generation loop (not once per token)."""
        with gathered_model(self.module) as module:
            yield module

    def destroy(self) -> None:
        self.wait_for_checkpoint()
        if self.optimizer is not None:
            self.optimizer.destroy()
        if self.config.comms_logger.enabled:
            self._log_comm_summary()
            set_device_sync(None)
        self.monitor.close()  # last: a writer error it raises leaves nothing else undone

    def _log_comm_summary(self) -> None:
        """The comms_logger table at the end: time and bandwidth per collective, and its
        share of the training time (first forward to now)."""
        elapsed = time.perf_counter() - self._started if self._started is not None else None
        log_rank0(
            "communication summary (this rank, %s of training):\n%s",
            f"{elapsed:.2f} s" if elapsed else "no",
            comm.summary_table(elapsed),
        )

    # ---------------------------------------------------------------------- helpers
    def _require_optimizer(self) -> ZeroOptimizer:
        if self.optimizer is None:
            raise RuntimeError(
                "this engine has no optimizer: pass optimizer= to initialize() or add an "
                "'optimizer' block to the config"
            )
        return self.optimizer

    def _report_skipped_step(self, opt: ZeroOptimizer) -> NonFiniteGradientError | None:
        """Log a step skipped for non-finite gradients, or return the error to raise.

        Every rank reaches the same verdict (the norm is reduced over all ranks), so the
        error, when configured, is raised everywhere at the same step and nobody hangs.
        """
        step, norm = self.global_steps + 1, opt.global_grad_norm
        if opt.skipped_on_request:
            log_rank0(
                f"step {step} skipped on request (optimizer.skip_step, e.g. RLHF's "
                "align_overflow after the other model overflowed); parameters and optimizer "
                "state unchanged",
                level=logging.WARNING,
            )
            return None
        if self._last_loss is not None and not bool(torch.isfinite(self._last_loss).all()):
            # Rank-local hint (no communication): which rank produced the bad loss.
            logger.warning(
                "rank %d: the last loss before step %d is %s",
                comm.get_rank(),
                step,
                float(self._last_loss),
            )
        if self.config.nonfinite_gradients == "error" and not opt.loss_scaler.dynamic:
            return NonFiniteGradientError(nonfinite_error_message(step, norm))
        log_rank0(skipped_step_message(step, norm, opt.loss_scaler), level=logging.WARNING)
        return None

    def _accumulate_loss(self, loss: torch.Tensor) -> None:
        """Sum the micro-batch losses of the accumulation window on the device (no sync).

        The first loss is copied (in fp32): the caller still holds it and may change it in
        place (``dist.all_reduce(loss)`` for logging); each later sum is a new tensor.
        """
        if self._window_loss is None:
            self._window_loss = loss.clone() if loss.dtype == torch.float32 else loss.float()
        else:
            self._window_loss = self._window_loss + loss
        self._window_micro += 1

    def _write_monitor(self) -> None:
        """DeepSpeed's per-step events at ``global_samples`` (after this step): the mean loss
        of the window, the lr of the first param group and, with fp16, the loss scale.

        The loss stays a device tensor that only the engine holds (``_accumulate_loss``), so
        it goes to the monitor uncopied: the monitor reads it in its next once-a-second batch.
        """
        step = self.global_samples
        events: list[tuple[str, Any, int]] = []
        if self._window_loss is not None:
            loss, micro = self._window_loss, self._window_micro
            events.append(("Train/Samples/train_loss", loss / micro if micro > 1 else loss, step))
        events.append(("Train/Samples/lr", self.get_lr()[0], step))
        if self.fp16_enabled():
            events.append(("Train/Samples/loss_scale", self._require_optimizer().loss_scale, step))
        self._window_loss, self._window_micro = None, 0
        self.monitor.write_owned_events(events)

    def _maybe_print(self) -> None:
        every = self.config.steps_per_print
        if not every or self.global_steps % every:
            return
        now = time.perf_counter()
        elapsed, self._last_print = now - self._last_print, now
        rate = every * self.train_batch_size() / max(elapsed, 1e-9)
        loss = float(self._last_loss) if self._last_loss is not None else float("nan")
        norm = self.get_global_grad_norm()
        msg = (
            f"step={self.global_steps} loss={loss:.4f} lr={self.get_lr()} "
            f"grad_norm={norm if norm is None else round(norm, 4)} samples/s={rate:.1f}"
        )
        if self.flops_profiler is not None:
            msg += self.flops_profiler.mfu_report(every, elapsed)
        if self.memory is not None:
            msg += " | " + self.memory.report(self.optimizer)
        if self.config.wall_clock_breakdown:
            msg += " | " + self._timers.report(every)
        log_rank0(msg)
        if self.config.comms_logger.enabled:
            comm.log_summary()


def _cast_floats(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.to(dtype)
    return x


DeepSpeedEngine = Engine
"""``deepspeed.runtime.engine.DeepSpeedEngine``: frameworks ``isinstance``-check engines
against it, and every slipstream engine (the pipeline engine too) is an ``Engine``."""
