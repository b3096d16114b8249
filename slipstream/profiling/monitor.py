"""Training monitors: TensorBoard, CSV, Weights & Biases and Comet behind DeepSpeed's
``MonitorMaster.write_events([(name, value, step), ...])``.

Only global rank 0 writes, and writing costs the training step little (under 1% of even
the tiny GPT's step; docs/observability.md has the measurements):

- ``write_events`` only checks the events and stages them; a tensor value is snapshotted on
  its device (one copy, no synchronization) and stays there.
- Once per ``write_interval`` (1 s), the next write hands everything staged to the writer
  thread as one batch: the tensor values of each device and dtype are stacked and copied to
  the host with one non-blocking copy, so a step adds no device-to-host transfer of its own.
- The writer thread waits for those copies and writes the batch to every backend at once
  (TensorBoard gets one event per step holding all of that step's scalars), so its Python
  work, and with it the GIL it takes from the training thread, is one short burst a second.

``flush()`` waits for every event to reach the backends; ``close()`` (called by
``engine.destroy()`` and at interpreter exit) flushes and closes them.
"""

from __future__ import annotations

import atexit
import csv
import importlib
import itertools
import logging
import numbers
import os
import queue
import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple, Protocol

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
    "ScalarEvent",
    "TensorBoardMonitor",
    "WandbMonitor",
    "csv_file_name",
    "scalar_events",
]

Event = tuple[str, Any, int]
"""(name, value, step): a scalar ``value`` (number or one-element tensor) at ``step``."""


class ScalarEvent(NamedTuple):
    """One event as the backends receive it: a plain number, and the wall-clock time of the
    ``write_events`` call (not of the write, which comes up to ``write_interval`` later)."""

    name: str
    value: float
    step: int
    wall_time: float


class Backend(Protocol):
    """One monitor library; called from the writer thread only, with plain numbers, in the
    order the events were written."""

    def write(self, events: Sequence[ScalarEvent]) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


def _by_step(events: Sequence[ScalarEvent]) -> Iterable[tuple[int, list[ScalarEvent]]]:
    """Runs of consecutive events with the same step (one ``write_events`` call, usually)."""
    for step, run in itertools.groupby(events, key=lambda e: e.step):
        yield step, list(run)


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
    """Scalars through ``torch.utils.tensorboard.SummaryWriter`` in ``output_path/job_name``.

    The scalars of one step go into one ``Summary`` (what ``add_scalar`` writes, with several
    values): tensorboard without TensorFlow checksums every record in pure Python, about
    0.2 us a byte, so one record per step instead of one per scalar halves the writer's work.
    """

    max_queue = 4096
    """SummaryWriter's queue of records: with its default of 10, every 10th record blocks
    until the SummaryWriter's own thread catches up, and the two threads trade the GIL per
    record (3x the CPU time). Nothing waits on it: every batch ends with a flush."""

    def __init__(self, config: TensorBoardConfig) -> None:
        _require("tensorboard", "tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = _job_dir(config.output_path, config.job_name)
        self.writer = SummaryWriter(log_dir=self.log_dir, max_queue=self.max_queue)

    def write(self, events: Sequence[ScalarEvent]) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        file_writer: Any = self.writer.file_writer  # public; add_scalar writes through it
        for step, run in _by_step(events):
            values = [Summary.Value(tag=e.name, simple_value=e.value) for e in run]
            file_writer.add_summary(Summary(value=values), step, run[0].wall_time)
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

    def write(self, events: Sequence[ScalarEvent]) -> None:
        rows: dict[str, list[tuple[int, float]]] = {}
        headers: dict[str, str] = {}
        for name, value, step, _ in events:
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
    """A W&B run (``wandb.init(project, group, entity=team)``); the events of one step are one
    ``wandb.log({name: value, ...}, step=step)`` (one history row, as W&B merges the logs of a
    step anyway). ``WANDB_MODE=offline`` needs no network."""

    def __init__(self, config: WandbConfig) -> None:
        self.wandb = _require("wandb", "wandb", "wandb")
        self.run = self.wandb.init(project=config.project, group=config.group, entity=config.team)

    def write(self, events: Sequence[ScalarEvent]) -> None:
        for step, run in _by_step(events):
            self.run.log({e.name: e.value for e in run}, step=step)

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

    def write(self, events: Sequence[ScalarEvent]) -> None:
        for name, value, step, _ in events:
            last = self.last_logged.get(name)
            if last is not None and step - last < self.interval:
                continue
            self.last_logged[name] = step
            self.experiment.log_metric(name, value, step=step)

    def flush(self) -> None:
        self.experiment.flush()

    def close(self) -> None:
        self.experiment.end()


class _Batch:
    """Events on their way to the writer thread: numbers as they are, tensor values in host
    copies that may still be in flight (each with the event that marks its arrival)."""

    def __init__(self, events: list[tuple[str, int, float]], numbers: list[float]) -> None:
        self.events = events
        """(name, step, wall_time) of every event, in write order."""
        self.numbers = numbers
        """The value of every event; a placeholder where it is in ``copies``."""
        self.copies: list[tuple[list[int], torch.Tensor, Any]] = []
        """(event indices, host tensor of their values, accelerator event or None)."""

    def resolve(self) -> list[ScalarEvent]:
        """Plain events; waits for the copies (on the writer thread, never the training one)."""
        values = self.numbers
        for indices, host, done in self.copies:
            if done is not None:
                done.synchronize()
            for index, value in zip(indices, host.tolist(), strict=True):
                values[index] = float(value)
        return [
            ScalarEvent(name, values[i], step, wall)
            for i, (name, step, wall) in enumerate(self.events)
        ]


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


def scalar_events(event_list: Iterable[Any]) -> list[ScalarEvent]:
    """Checked ``(name, value, step)`` events as the backends take them, read now (a tensor
    value is copied to the host here) and stamped with the current wall-clock time.

    Raises ``ValueError`` for a malformed event, naming it."""
    now = time.time()
    return [
        ScalarEvent(name, float(value), step, now)
        for name, value, step in (_check_event(e, i) for i, e in enumerate(event_list))
    ]


def _snapshot(value: torch.Tensor) -> torch.Tensor:
    """A 0-dim copy on the tensor's device: a later in-place update (``loss /= n``, an
    all-reduce for logging) must not change the event. Queued on the device, no sync."""
    value = value.detach()
    return (value if value.dim() == 0 else value.reshape(())).clone()


def _to_host(staged: list[tuple[list[Event], float]]) -> _Batch:
    """One batch of staged events; the tensor values of each (device, dtype) are stacked and,
    off the CPU, copied to the host with one non-blocking copy whose completion an
    accelerator event marks for the writer thread."""
    events: list[tuple[str, int, float]] = []
    numbers: list[float] = []
    groups: dict[tuple[torch.device, torch.dtype], tuple[list[int], list[torch.Tensor]]] = {}
    for event_list, wall in staged:
        for name, value, step in event_list:
            if isinstance(value, torch.Tensor):
                indices, tensors = groups.setdefault((value.device, value.dtype), ([], []))
                indices.append(len(events))
                tensors.append(value)
                value = 0.0
            events.append((name, step, wall))
            numbers.append(float(value))
    batch = _Batch(events, numbers)
    for (device, _), (indices, tensors) in groups.items():
        host = torch.stack(tensors)
        done = None
        if device.type != "cpu":
            acc = get_accelerator()
            host = host.to("cpu", non_blocking=True)
            done = acc.Event()
            done.record(acc.current_stream(device.index))
        batch.copies.append((indices, host, done))
    return batch


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
        self._queue: queue.SimpleQueue[_Batch | threading.Event | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()  # a forked child (e.g. a DataLoader worker) must not write
        self._staged: list[tuple[list[Event], float]] = []  # (events, wall time) of each write
        self._stage_lock = threading.Lock()  # writes from several threads lose nothing
        self._hand_over_at = 0.0  # time.monotonic() after which the next write hands over
        self.write_interval = write_interval
        """Seconds between the batches handed to the writer thread: a crash that skips the
        exit handlers (a kill) loses about this much."""
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
        """Write ``(name, value, step)`` events to every enabled monitor (rank 0 only).

        ``value`` is a number or a one-element tensor, read as it is now: a tensor is copied
        on its device (no synchronization) and reaches the host with the next batch.
        Raises ``ValueError`` for a malformed event, here rather than in the writer.
        """
        if self._thread is None or os.getpid() != self._pid:
            return
        events = [_check_event(e, i) for i, e in enumerate(event_list)]
        self._stage(
            [(n, _snapshot(v) if isinstance(v, torch.Tensor) else v, s) for n, v, s in events]
        )

    def write_owned_events(self, event_list: list[Event]) -> None:
        """``write_events`` for a caller that builds well-formed events and never changes
        their tensor values afterwards (0-dim tensors it alone holds, as the engine's loss):
        neither checked nor copied, so the step pays only for staging them."""
        if self._thread is None or os.getpid() != self._pid:
            return
        self._stage(event_list)

    def flush(self) -> None:
        """Wait until every event written so far is written by the backends, then flush them."""
        if not self.active:
            return
        done = threading.Event()
        self._hand_over()
        self._queue.put(done)
        done.wait()
        self._raise_writer_error()

    def close(self) -> None:
        """Flush and close every monitor; later calls do nothing."""
        if not self.active or self._thread is None:
            return
        self._hand_over()
        self._closed = True
        self._queue.put(None)
        self._thread.join()
        self._raise_writer_error()

    def _stage(self, events: list[Event]) -> None:
        """Keep the events for the next batch; hand the batch over once the interval is up."""
        self._raise_writer_error()
        if self._closed:
            raise RuntimeError("write_events after the monitor was closed (engine.destroy())")
        if not events:
            return
        with self._stage_lock:
            self._staged.append((events, time.time()))
        if time.monotonic() >= self._hand_over_at:
            self._hand_over()

    def _hand_over(self) -> None:
        """Queue everything staged as one batch for the writer thread (its device values on
        their way to the host)."""
        with self._stage_lock:
            staged, self._staged = self._staged, []
            self._hand_over_at = time.monotonic() + self.write_interval
            if staged:
                self._queue.put(_to_host(staged))

    def _raise_writer_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"a training monitor failed while writing events: {error}") from (
                error
            )

    def _run(self) -> None:
        """Writer thread: write each batch as it comes (all queued batches at once), then
        serve the flush/close requests queued with them. The batches come once per
        ``write_interval``, so the thread wakes about once a second."""
        while True:
            items = [self._queue.get()]
            while True:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            self._guarded(self._write, [i for i in items if isinstance(i, _Batch)])
            for item in items:
                if item is None:
                    self._guarded(self._close_backends)
                    return
                if isinstance(item, threading.Event):
                    self._guarded(self._flush_backends)
                    item.set()

    def _guarded(self, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except BaseException as exc:  # surfaced on the training thread, never lost
            self._error = exc

    def _write(self, batches: list[_Batch]) -> None:
        if batches:
            events = [e for b in batches for e in b.resolve()]
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
