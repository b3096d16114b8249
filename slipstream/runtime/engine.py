"""The training engine: sequences forward, backward and step. It holds no feature logic.

Gradient reduction, sharding, precision and clipping live in the ZeRO optimizer and its
reducer (``slipstream.zero``); the engine counts micro-steps, scales the loss and calls
them in order, with DeepSpeed's method names. What watches training (timers, the FLOPs
profiler, the memory breakdown, monitors, the comms logger, the throughput timer, the step
line) is a list of observers built from the config (``slipstream.runtime.observers``) that the
engine calls at each phase, loss, step and at ``destroy``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from slipstream._logging import log_rank0, logger
from slipstream.checkpoint.api import PendingSave, finish_save, load_checkpoint, save_checkpoint
from slipstream.config import ConfigError
from slipstream.config.schema import SlipstreamConfig
from slipstream.distributed import comm
from slipstream.precision import (
    NonFiniteGradientError,
    nonfinite_error_message,
    skipped_step_message,
)
from slipstream.profiling.monitor import MonitorMaster
from slipstream.runtime._deepspeed_engine import DeepSpeedEngineAttributes
from slipstream.runtime.compile import compile_module_
from slipstream.runtime.memory_report import MemoryBreakdown
from slipstream.runtime.observers import EngineObserver, build_observers, close_all, observed
from slipstream.runtime.step_profiler import StepProfiler
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
        self._compiled = False
        self.monitor = MonitorMaster.from_config(config)
        """DeepSpeed's ``engine.monitor``: ``write_events([(name, value, step), ...])`` sends
        user scalars to the configured monitors (rank 0 only)."""
        self.observers: list[EngineObserver] = build_observers(
            config, module, device, self.tput_timer
        )
        """What watches training, built from the config (``slipstream.runtime.observers``)."""
        self.flops_profiler: StepProfiler | None = _find(self.observers, StepProfiler)
        """``flops_profiler`` (rank 0): the profiled step's FLOPs, the MFU of later steps."""
        self.memory: MemoryBreakdown | None = _find(self.observers, MemoryBreakdown)
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
        with observed(self.observers, self, "forward"):
            return self.module(*inputs, **kwargs)

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
        self._observe_loss(loss.detach())
        scaled = self.scale(loss)
        if not scale_wrt_gas and self.config.managed_gradient_accumulation:
            scaled = scaled * self.gradient_accumulation_steps()
        with observed(self.observers, self, "backward"):
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
            with observed(self.observers, self, "step"):
                self._step_applied = opt.step()
            # As DeepSpeed: a skipped step leaves the lr schedule alone but counts as a step.
            if self._step_applied:
                if self.lr_scheduler is not None:
                    self.lr_scheduler.step(**(lr_kwargs or {}))
            else:
                self.skipped_steps += 1
                error = self._report_skipped_step(opt)
            self.global_steps += 1
            self.global_samples += self.train_batch_size()
            for observer in self.observers:
                observer.on_step(self)
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
        close_all(self.observers, self)  # a monitor writer's error is raised after all close

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

    def _observe_loss(self, loss: torch.Tensor) -> None:
        """Keep ``loss`` (detached) for the step line and hand it to the observers."""
        self._last_loss = loss
        for observer in self.observers:
            observer.on_loss(self, loss)


def _find(observers: list[EngineObserver], kind: type[Any]) -> Any:
    return next((o for o in observers if isinstance(o, kind)), None)


def _cast_floats(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.to(dtype)
    return x


DeepSpeedEngine = Engine
"""``deepspeed.runtime.engine.DeepSpeedEngine``: frameworks ``isinstance``-check engines
against it, and every slipstream engine (the pipeline engine too) is an ``Engine``."""
