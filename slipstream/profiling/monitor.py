"""Training monitors: TensorBoard, CSV, Weights & Biases and Comet behind DeepSpeed's
``MonitorMaster.write_events([(name, value, step), ...])``.

Only global rank 0 writes. Writing never blocks the training step: ``write_events`` only
queues the events (a device tensor value is copied to the host asynchronously), and a
background thread, once per ``write_interval`` (1 s), turns the queued values into numbers
and hands them to the backends in one batch, so file I/O and the wait for the device happen
off the training thread. ``flush()`` waits for every
queued event to reach the backends; ``close()`` (called by ``engine.destroy()`` and at
interpreter exit) flushes and closes them.
"""

from __future__ import annotations

import atexit
import csv
import importlib
import logging
import numbers
import os
import queue
import threading
import weakref
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import torch

from slipstream._logging import global_rank, logger
from slipstream.accelerator import get_accelerator
from slipstream.config.monitor import (
    CometConfig,
    CSVMonitorConfig,
    TensorBoardConfig,
    WandbConfig,
)

__all__ = [
    "CSVMonitor",
    "CometMonitor",
    "MonitorMaster",
    "TensorBoardMonitor",
    "WandbMonitor",
    "csv_file_name",
]

Event = tuple[str, Any, int]
"""(name, value, step): a scalar ``value`` (number or one-element tensor) at ``step``."""


class Backend(Protocol):
    """One monitor library; called from the writer thread only, with plain numbers."""

    def write(self, events: Sequence[tuple[str, float, int]]) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


def _require(module: str, package: str, key: str) -> Any:
    """Import an optional monitor library or say which pip package the config key needs."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"config key '{key}.enabled' is true but the '{package}' package is not installed: "
            f"pip install {package} (or set {key}.enabled to false)"
        ) from exc


def _job_dir(output_path: str, job_name: str) -> str:
    """``output_path/job_name`` (DeepSpeed's layout; "" means the working directory)."""
    path = os.path.join(output_path, job_name)
    os.makedirs(path, exist_ok=True)
    return path


class TensorBoardMonitor:
    """Scalars through ``torch.utils.tensorboard.SummaryWriter`` in ``output_path/job_name``."""

    def __init__(self, config: TensorBoardConfig) -> None:
        _require("tensorboard", "tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = _job_dir(config.output_path, config.job_name)
        self.writer = SummaryWriter(log_dir=self.log_dir)

    def write(self, events: Sequence[tuple[str, float, int]]) -> None:
        for name, value, step in events:
            self.writer.add_scalar(name, value, step)
        # Each batch is flushed (DeepSpeed flushes every call): events survive a crash, and
        # this runs on the writer thread, so the flush costs the training step nothing.
        self.writer.flush()

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def csv_file_name(name: str) -> str:
    """The CSV file of a scalar: '/' and ' ' become '_' (``Train/Samples/lr`` ->
    ``Train_Samples_lr.csv``), as DeepSpeed's csv_monitor names them."""
    return name.replace("/", "_").replace(" ", "_") + ".csv"


class CSVMonitor:
    """One ``<name>.csv`` per scalar in ``output_path/job_name``, rows ``step,value`` under a
    ``step,<last name component>`` header (DeepSpeed's csv_monitor layout).

    Files are appended to, so a resumed run continues them; the header is written only
    when a file is new or empty.
    """

    def __init__(self, config: CSVMonitorConfig) -> None:
        self.log_dir = _job_dir(config.output_path, config.job_name)

    def write(self, events: Sequence[tuple[str, float, int]]) -> None:
        rows: dict[str, list[tuple[int, float]]] = {}
        headers: dict[str, str] = {}
        for name, value, step in events:
            path = os.path.join(self.log_dir, csv_file_name(name))
            rows.setdefault(path, []).append((step, value))
            headers[path] = name.rsplit("/", 1)[-1]
        for path, file_rows in rows.items():
            with open(path, "a", newline="") as handle:
                writer = csv.writer(handle)
                if handle.tell() == 0:
                    writer.writerow(["step", headers[path]])
                # repr keeps every bit of the float (str would too on Python 3, explicitly).
                writer.writerows((step, repr(value)) for step, value in file_rows)

    def flush(self) -> None:
        """Every write closes its files, so there is nothing buffered."""

    def close(self) -> None:
        """Nothing is held open."""


class WandbMonitor:
    """A W&B run (``wandb.init(project, group, entity=team)``); each event is one
    ``wandb.log({name: value}, step=step)``. ``WANDB_MODE=offline`` needs no network."""

    def __init__(self, config: WandbConfig) -> None:
        self.wandb = _require("wandb", "wandb", "wandb")
        self.run = self.wandb.init(project=config.project, group=config.group, entity=config.team)

    def write(self, events: Sequence[tuple[str, float, int]]) -> None:
        for name, value, step in events:
            self.run.log({name: value}, step=step)

    def flush(self) -> None:
        """W&B streams records to its own service process; nothing to force here."""

    def close(self) -> None:
        self.run.finish()


class CometMonitor:
    """A Comet experiment (``comet_ml.start``); a scalar is logged at most once every
    ``samples_log_interval`` samples, as DeepSpeed's Comet monitor does."""

    def __init__(self, config: CometConfig) -> None:
        comet_ml = _require("comet_ml", "comet_ml", "comet")
        self.interval = config.samples_log_interval
        self.last_logged: dict[str, int] = {}
        self.experiment = comet_ml.start(
            api_key=config.api_key,
            project=config.project,
            workspace=config.workspace,
            experiment_key=config.experiment_key,
            mode=config.mode,
            online=config.online,
        )
        if config.experiment_name is not None:
            self.experiment.set_name(config.experiment_name)

    def write(self, events: Sequence[tuple[str, float, int]]) -> None:
        for name, value, step in events:
            last = self.last_logged.get(name)
            if last is not None and step - last < self.interval:
                continue
            self.last_logged[name] = step
            self.experiment.log_metric(name, value, step=step)

    def flush(self) -> None:
        self.experiment.flush()

    def close(self) -> None:
        self.experiment.end()


class _Pending:
    """Events on their way to the writer thread; device values are in flight to the host."""

    def __init__(self, events: list[Event], copied: list[Any]) -> None:
        self.events = events
        self.copied = copied

    def resolve(self) -> list[tuple[str, float, int]]:
        for event in self.copied:
            event.synchronize()  # waits on the writer thread, not the training thread
        return [(name, _number(value), step) for name, value, step in self.events]


def _number(value: Any) -> float:
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


def _check_event(event: Any, index: int) -> Event:
    """Validate one ``(name, value, step)`` on the caller's thread, so a bad event is an error
    where it was written, not a lost line later."""
    if not isinstance(event, tuple | list) or len(event) != 3:
        raise ValueError(f"monitor event {index} = {event!r}: expected a (name, value, step) tuple")
    name, value, step = event
    if not isinstance(name, str) or not name:
        raise ValueError(f"monitor event {index}: name {name!r} must be a non-empty string")
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise ValueError(
            f"monitor event '{name}': step {step!r} must be an integer (DeepSpeed uses "
            "engine.global_samples)"
        )
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"monitor event '{name}': value is a tensor of shape {tuple(value.shape)}; "
                "log a scalar (e.g. loss.mean())"
            )
    elif isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"monitor event '{name}': value {value!r} must be a real number")
    return name, value, int(step)


def _to_host(events: list[Event]) -> _Pending:
    """Snapshot tensor values: a host copy now, or a device-to-host copy that is only
    queued on the tensor's stream (an event marks its completion for the writer thread)."""
    copied: list[Any] = []  # accelerator events
    out: list[Event] = []
    for name, value, step in events:
        if isinstance(value, torch.Tensor):
            value = value.detach().reshape(())
            if value.device.type != "cpu":
                acc = get_accelerator()
                device = value.device
                value = value.to("cpu", non_blocking=True)
                done = acc.Event()
                done.record(acc.current_stream(device.index))
                copied.append(done)
            else:
                value = value.clone()  # a later in-place update must not change the event
        out.append((name, value, step))
    return _Pending(out, copied)


class MonitorMaster:
    """DeepSpeed's ``MonitorMaster``: fans ``write_events`` out to the enabled monitors.

    ``enabled`` is true on every rank when any monitor is configured; the backends exist on
    global rank 0 only, and ``write_events`` elsewhere is a no-op (as in DeepSpeed).
    """

    def __init__(
        self,
        tensorboard: TensorBoardConfig | None = None,
        csv_monitor: CSVMonitorConfig | None = None,
        wandb: WandbConfig | None = None,
        comet: CometConfig | None = None,
        rank: int | None = None,
        write_interval: float = 1.0,
    ) -> None:
        configs = [c for c in (tensorboard, csv_monitor, wandb, comet) if c is not None]
        self.enabled = any(c.enabled for c in configs)
        self.backends: list[Backend] = []
        self._closed = False
        self._error: BaseException | None = None
        self._queue: queue.SimpleQueue[_Pending | threading.Event | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()  # cuts the writer's wait short for flush/close
        self._pid = os.getpid()  # a forked child (e.g. a DataLoader worker) must not write
        self.write_interval = write_interval
        """Seconds between the writer's batches: at most this much is lost to a crash."""
        if not self.enabled or (global_rank() if rank is None else rank) != 0:
            return
        if tensorboard is not None and tensorboard.enabled:
            self.backends.append(TensorBoardMonitor(tensorboard))
        if wandb is not None and wandb.enabled:
            self.backends.append(WandbMonitor(wandb))
        if csv_monitor is not None and csv_monitor.enabled:
            self.backends.append(CSVMonitor(csv_monitor))
        if comet is not None and comet.enabled:
            self.backends.append(CometMonitor(comet))
        self._thread = threading.Thread(target=self._run, name="slipstream-monitor", daemon=True)
        self._thread.start()
        _close_at_exit(self)

    @classmethod
    def from_config(cls, config: Any, rank: int | None = None) -> MonitorMaster:
        """The monitors of a ``SlipstreamConfig``."""
        return cls(config.tensorboard, config.csv_monitor, config.wandb, config.comet, rank)

    @property
    def active(self) -> bool:
        """True where events are actually written (rank 0 with a monitor enabled)."""
        return self._thread is not None and not self._closed and os.getpid() == self._pid

    def write_events(self, event_list: Iterable[Event]) -> None:
        """Queue ``(name, value, step)`` events for every enabled monitor (rank 0 only).

        ``value`` is a number or a one-element tensor; a device tensor is copied to the host
        asynchronously, so this never waits for the device.
        """
        if self._thread is None or os.getpid() != self._pid:
            return
        self._raise_writer_error()
        if self._closed:
            raise RuntimeError("write_events after the monitor was closed (engine.destroy())")
        events = [_check_event(e, i) for i, e in enumerate(event_list)]
        if events:
            self._queue.put(_to_host(events))

    def flush(self) -> None:
        """Wait until every queued event is written, then flush the backends."""
        if not self.active:
            return
        done = threading.Event()
        self._queue.put(done)
        self._wake.set()
        done.wait()
        self._raise_writer_error()

    def close(self) -> None:
        """Flush and close every monitor; later calls do nothing."""
        if not self.active or self._thread is None:
            return
        self._closed = True
        self._queue.put(None)
        self._wake.set()
        self._thread.join()
        self._raise_writer_error()

    def _raise_writer_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"a training monitor failed while writing events: {error}") from (
                error
            )

    def _run(self) -> None:
        """Writer thread: every ``write_interval`` seconds (or at once on flush/close), write
        all queued events as one batch, then serve the flush/close requests among them.

        Batching keeps the writer's Python work (and so its share of the GIL) to one burst
        per interval instead of one per step, which matters for short steps.
        """
        while True:
            items = [self._queue.get()]
            while True:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            control = [i for i in items if not isinstance(i, _Pending)]
            self._guarded(self._write, [i for i in items if isinstance(i, _Pending)])
            for item in control:
                if item is None:
                    self._guarded(self._close_backends)
                    return
                self._guarded(self._flush_backends)
                item.set()
            if not control:
                self._wake.wait(self.write_interval)
            self._wake.clear()

    def _guarded(self, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except BaseException as exc:  # surfaced on the training thread, never lost
            self._error = exc

    def _write(self, pending: list[_Pending]) -> None:
        if pending:
            events = [e for p in pending for e in p.resolve()]
            for backend in self.backends:
                backend.write(events)

    def _flush_backends(self) -> None:
        for backend in self.backends:
            backend.flush()

    def _close_backends(self) -> None:
        for backend in self.backends:
            backend.close()


def _close_at_exit(monitor: MonitorMaster) -> None:
    """Close ``monitor`` at interpreter exit unless it was closed (or collected) before."""
    ref = weakref.ref(monitor)

    def close() -> None:
        live = ref()
        if live is None:
            return
        try:
            live.close()
        except Exception as exc:  # exit must not crash; say what was lost instead
            logger.log(logging.ERROR, "closing the training monitors at exit failed: %s", exc)

    atexit.register(close)
