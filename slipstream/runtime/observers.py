"""The engine's observers, each built from its config block into one list.

As torchtitan builds its metrics, profiler and checkpointer from config and the trainer calls
them in a loop, :func:`build_observers` turns the config's observation blocks into a list of
:class:`~slipstream.runtime._observer.EngineObserver` and the engine calls the list at each
phase, loss, optimizer step, step line and at ``destroy``; none of them changes training.

The list's order is the order of the step line's parts and of the per-step work:

1. the FLOPs step profiler (``flops_profiler``; rank 0): profiles one step, then
   ``TFLOPS=... MFU=...``;
2. the memory breakdown (``memory_breakdown``): memory at each phase's end;
3. the wall-clock timers (``wall_clock_breakdown``): milliseconds per phase;
4. DeepSpeed's throughput timer (``engine.tput_timer``);
5. the engine's monitor events (loss, lr, loss scale to ``engine.monitor``), and with MoE
   layers their routing statistics;
6. the step line itself (``steps_per_print``), which asks every observer for its part;
7. the comms logger (``comms_logger``): the communication summary after each step line and at
   the end.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from slipstream._logging import log_rank0
from slipstream.accelerator import get_accelerator
from slipstream.config.schema import SlipstreamConfig
from slipstream.distributed import comm
from slipstream.distributed.timeouts import set_device_sync
from slipstream.moe import moe_layers
from slipstream.runtime._deepspeed_engine import ThroughputTimer
from slipstream.runtime._observer import EngineObserver
from slipstream.runtime.memory_report import MemoryBreakdown
from slipstream.runtime.step_profiler import StepProfiler
from slipstream.runtime.timers import StepTimers

__all__ = [
    "CommsLogger",
    "EngineObserver",
    "RoutingEvents",
    "StepPrinter",
    "TrainingEvents",
    "build_observers",
    "close_all",
    "observed",
]


def _print_due(engine: Any) -> bool:
    every = engine.config.steps_per_print
    return bool(every) and engine.global_steps % every == 0


class TrainingEvents(EngineObserver):
    """DeepSpeed's per-step monitor events at ``global_samples`` (after the step): the mean
    loss of the accumulation window, the lr of the first param group and, with fp16, the loss
    scale. Writes to ``engine.monitor`` as it is at each step (a script may swap it).

    The window's loss is summed on the device (no sync) and handed to the monitor uncopied:
    only this observer holds it, and the monitor reads it in its next once-a-second batch.
    """

    def __init__(self) -> None:
        self._window_loss: torch.Tensor | None = None  # sum of this window's micro losses
        self._window_micro = 0

    def on_loss(self, engine: Any, loss: torch.Tensor) -> None:
        """The first loss is copied (in fp32): the caller still holds it and may change it in
        place (``dist.all_reduce(loss)`` for logging); each later sum is a new tensor."""
        if not engine.monitor.active:
            return
        if self._window_loss is None:
            self._window_loss = loss.clone() if loss.dtype == torch.float32 else loss.float()
        else:
            self._window_loss = self._window_loss + loss
        self._window_micro += 1

    def on_step(self, engine: Any) -> None:
        if not engine.monitor.active:
            return
        step = engine.global_samples
        events: list[tuple[str, Any, int]] = []
        if self._window_loss is not None:
            loss, micro = self._window_loss, self._window_micro
            events.append(("Train/Samples/train_loss", loss / micro if micro > 1 else loss, step))
        events.append(("Train/Samples/lr", engine.get_lr()[0], step))
        if engine.fp16_enabled():
            events.append(("Train/Samples/loss_scale", engine.optimizer.loss_scale, step))
        self._window_loss, self._window_micro = None, 0
        engine.monitor.write_owned_events(events)

    def close(self, engine: Any) -> None:
        engine.monitor.close()


class RoutingEvents(EngineObserver):
    """MoE routing statistics to ``engine.monitor`` at ``global_samples`` after each step, per
    MoE layer ``i`` (module order), over this rank's micro-batches of the accumulation window
    (rank 0's are the ones written, as every monitor writes on rank 0 only):

    - ``Train/Samples/moe/<i>/expert<e>_tokens``: choices routed to expert ``e``, before
      capacity dropping;
    - ``Train/Samples/moe/<i>/dropped_fraction``: dropped choices / routed choices;
    - ``Train/Samples/moe/<i>/imbalance``: the busiest expert's routed load over the mean.

    The counts of a micro-batch are those of the layer's last forward before ``backward``.
    """

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        self.layers = list(layers)
        self._routed: dict[int, torch.Tensor] = {}
        self._kept: dict[int, torch.Tensor] = {}

    def on_loss(self, engine: Any, loss: torch.Tensor) -> None:
        if not engine.monitor.active:
            return
        for i, layer in enumerate(self.layers):
            stats = getattr(layer, "stats", None)
            if stats is None:
                continue
            routed = stats.tokens_per_expert.to(torch.float64)
            kept = stats.kept_per_expert.to(torch.float64)
            if i in self._routed:
                routed, kept = routed + self._routed[i], kept + self._kept[i]
            self._routed[i], self._kept[i] = routed, kept

    def on_step(self, engine: Any) -> None:
        if not engine.monitor.active or not self._routed:
            return
        step = engine.global_samples
        events: list[tuple[str, Any, int]] = []
        for i, routed in self._routed.items():
            total = float(routed.sum())
            mean = total / max(routed.numel(), 1)
            prefix = f"Train/Samples/moe/{i}/"
            for e, n in enumerate(routed.tolist()):
                events.append((f"{prefix}expert{e}_tokens", n, step))
            dropped = 1.0 - float(self._kept[i].sum()) / total if total else 0.0
            events.append((f"{prefix}dropped_fraction", dropped, step))
            events.append((f"{prefix}imbalance", float(routed.max()) / mean if mean else 1.0, step))
        self._routed, self._kept = {}, {}
        engine.monitor.write_events(events)


class StepPrinter(EngineObserver):
    """The step line every ``steps_per_print`` optimizer steps (rank 0): step, loss, lr,
    gradient norm, samples/s, then each observer's part (:meth:`EngineObserver.on_print`)."""

    def __init__(self, observers: Sequence[EngineObserver]) -> None:
        self.observers = observers
        """The engine's list (this printer is in it): who contributes to the line."""
        self._last_print = time.perf_counter()

    def on_step(self, engine: Any) -> None:
        if not _print_due(engine):
            return
        every = engine.config.steps_per_print
        now = time.perf_counter()
        elapsed, self._last_print = now - self._last_print, now
        rate = every * engine.train_batch_size() / max(elapsed, 1e-9)
        last = engine._last_loss
        loss = float(last) if last is not None else float("nan")
        norm = engine.get_global_grad_norm()
        msg = (
            f"step={engine.global_steps} loss={loss:.4f} lr={engine.get_lr()} "
            f"grad_norm={norm if norm is None else round(norm, 4)} samples/s={rate:.1f}"
        )
        msg += "".join(o.on_print(engine, every, elapsed) for o in self.observers)
        log_rank0(msg)


class CommsLogger(EngineObserver):
    """``comms_logger``: the per-axis call and byte counts after each step line, and at the
    end the table of time and bandwidth per collective with its share of the training time
    (first forward to ``destroy``)."""

    def __init__(self, device: torch.device) -> None:
        self._started: float | None = None
        if device.type != "cpu":
            set_device_sync(get_accelerator().synchronize)  # per-collective times, as DeepSpeed's

    def phase(self, engine: Any, name: str) -> AbstractContextManager[None]:
        if name == "forward" and self._started is None:
            self._started = time.perf_counter()
        return nullcontext()

    def on_step(self, engine: Any) -> None:
        if _print_due(engine):
            comm.log_summary()

    def close(self, engine: Any) -> None:
        elapsed = time.perf_counter() - self._started if self._started is not None else None
        log_rank0(
            "communication summary (this rank, %s of training):\n%s",
            f"{elapsed:.2f} s" if elapsed else "no",
            comm.summary_table(elapsed),
        )
        set_device_sync(None)


def build_observers(
    config: SlipstreamConfig, module: nn.Module, device: torch.device, throughput: ThroughputTimer
) -> list[EngineObserver]:
    """The observers ``config`` asks for, in the module docstring's order.

    ``throughput`` is the engine's ``tput_timer`` (DeepSpeed scripts read it). The comms
    logger's counter settings (``verbose``, ``prof_ops``) apply whether or not it is enabled.
    """
    observers: list[EngineObserver] = []
    if config.flops_profiler.enabled and comm.get_rank() == 0:
        dtype = next((p.dtype for p in module.parameters()), torch.float32)
        observers.append(
            StepProfiler(config.flops_profiler, module, device, dtype, config.batch[2])
        )
    if config.memory_breakdown:
        observers.append(MemoryBreakdown(device))
    if config.wall_clock_breakdown:
        observers.append(StepTimers(device))
    observers += [throughput, TrainingEvents()]
    layers = moe_layers(module)
    if layers:
        observers.append(RoutingEvents(layers))
    if config.steps_per_print:
        observers.append(StepPrinter(observers))
    comm.comm_counters.verbose = config.comms_logger.verbose
    if not config.comms_logger.prof_all:
        comm.comm_counters.prof_ops = set(config.comms_logger.prof_ops)
    if config.comms_logger.enabled:
        observers.append(CommsLogger(device))
    return observers


@contextmanager
def observed(observers: Sequence[EngineObserver], engine: Any, name: str) -> Iterator[None]:
    """Every observer's :meth:`~EngineObserver.phase` around one engine phase, the first
    observer innermost."""
    with ExitStack() as stack:
        for observer in reversed(observers):
            stack.enter_context(observer.phase(engine, name))
        yield


def close_all(observers: Sequence[EngineObserver], engine: Any) -> None:
    """Close every observer, last first; an error (a monitor writer's) is raised after all
    are closed."""
    error: BaseException | None = None
    for observer in reversed(observers):
        try:
            observer.close(engine)
        except BaseException as e:
            error = error or e
    if error is not None:
        raise error
