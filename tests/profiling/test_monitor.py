"""Monitors: DeepSpeed's event names, steps and values in TensorBoard and CSV files, rank 0
only, flushed on destroy and at exit, W&B offline, and the config and usage errors."""

from __future__ import annotations

import csv
import os
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from slipstream.config import ConfigError, parse_config
from slipstream.config.monitor import CometConfig, CSVMonitorConfig, WandbConfig
from slipstream.profiling import MonitorMaster
from slipstream.profiling.monitor import ScalarEvent, WandbMonitor
from tests.distributed.harness import run_world
from tests.profiling import _monitor_workloads as w

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import (
    EventAccumulator,
)

TAGS = ["Train/Samples/lr", "Train/Samples/train_loss"]


def _read_csv(job_dir: Path) -> dict[str, tuple[list[str], list[tuple[int, float]]]]:
    """Every CSV file of a job: file name -> (header, rows)."""
    out = {}
    for path in sorted(job_dir.glob("*.csv")):
        with open(path, newline="") as f:
            header, *rows = list(csv.reader(f))
        out[path.name] = (header, [(int(s), float(v)) for s, v in rows])
    return out


def _tensorboard_events(job_dir: Path) -> EventAccumulator:
    files = list(job_dir.glob("events.out.tfevents.*"))
    assert len(files) == 1, files
    acc = EventAccumulator(str(files[0]))
    acc.Reload()
    return acc


def _read_tensorboard(job_dir: Path) -> dict[str, list[tuple[int, float]]]:
    acc = _tensorboard_events(job_dir)
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def _check_wall_times(out: Path, walls: list[tuple[int, float]]) -> None:
    """Each TensorBoard scalar carries the wall time of its step, not of the (later) write:
    after the previous step ended and before its own step returned."""
    acc = _tensorboard_events(out / "tb" / "run")
    for tag in TAGS:
        events = acc.Scalars(tag)
        assert [e.step for e in events] == [s for s, _ in walls[1:]]
        for event, (_, before), (_, after) in zip(events, walls[:-1], walls[1:], strict=True):
            assert before <= event.wall_time <= after


def _check_files(out: Path, expected: dict[str, list[tuple[int, float]]]) -> None:
    """TensorBoard and CSV hold exactly the expected events (TensorBoard stores float32)."""
    tb = _read_tensorboard(out / "tb" / "run")
    assert sorted(tb) == sorted([*expected, "User/n", "User/tokens"])
    table = _read_csv(out / "csv" / "run")
    for name, events in expected.items():
        steps = [s for s, _ in events]
        assert [s for s, _ in tb[name]] == steps
        assert [v for _, v in tb[name]] == pytest.approx([v for _, v in events], rel=1e-6)
        header, rows = table[name.replace("/", "_") + ".csv"]
        assert header == ["step", name.rsplit("/", 1)[-1]]
        assert [s for s, _ in rows] == steps
        assert [v for _, v in rows] == pytest.approx([v for _, v in events], rel=1e-6)
    assert tb["User/tokens"] == [(5, 123.0)] and tb["User/n"] == [(6, 2.0)]
    assert table["User_tokens.csv"] == (["step", "tokens"], [(5, 123.0)])


def test_engine_writes_deepspeed_events_fp16(tmp_path: Path) -> None:
    """Loss (window mean), lr and loss scale at global_samples after each step; flushed by
    destroy()."""
    result = w.train(str(tmp_path), steps=3, fp16=True)
    result["engine"].destroy()
    assert not result["engine"].monitor.active
    expected = result["expected"]
    assert sorted(expected) == sorted([*TAGS, "Train/Samples/loss_scale"])
    assert [s for s, _ in expected["Train/Samples/lr"]] == [4, 8, 12]
    assert len({v for _, v in expected["Train/Samples/lr"]}) == 3  # the warmup moves it
    _check_files(tmp_path, expected)
    _check_wall_times(tmp_path, result["walls"])


def test_two_ranks_only_rank0_writes_and_flushes_at_exit(tmp_path: Path) -> None:
    """Both ranks point at the same directory: one event file with rank 0's events once,
    all on disk although the ranks exit without engine.destroy(); a pipeline engine logs its
    batch loss."""
    results = run_world(w.train_and_exit, 2, str(tmp_path), 2)
    assert [(r["rank"], r["enabled"], r["active"]) for r in results] == [
        (0, True, True),
        (1, True, False),
    ]
    expected = results[0]["expected"]
    assert [s for s, _ in expected["Train/Samples/lr"]] == [8, 16]  # micro 2 x gas 2 x dp 2
    _check_files(tmp_path, expected)
    _check_wall_times(tmp_path, results[0]["walls"])
    # The pipeline engine logs train_batch's loss (the same on every stage) at 4, 8 samples.
    assert results[0]["pipe_losses"] == results[1]["pipe_losses"]
    header, rows = _read_csv(tmp_path / "pipe")["Train_Samples_train_loss.csv"]
    assert header == ["step", "train_loss"]
    assert [s for s, _ in rows] == [4, 8]
    assert [v for _, v in rows] == pytest.approx(results[0]["pipe_losses"], rel=1e-6)


class _Gate:
    """A backend that blocks until released: shows write_events does not wait for I/O."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.seen: list[tuple[str, float, int]] = []

    def write(self, events: Any) -> None:
        self.release.wait(timeout=30)
        self.seen.extend(events)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_write_events_does_not_wait_for_the_writer(tmp_path: Path) -> None:
    monitor = MonitorMaster(csv_monitor=CSVMonitorConfig(enabled=True, output_path=str(tmp_path)))
    gate = _Gate()
    monitor.backends.append(gate)
    value = torch.tensor(1.5)
    monitor.write_events([("a", value, 1)])
    monitor.write_events([("a", 2.5, 2)])  # returns although the first batch is stuck
    value.add_(10.0)  # the event holds the value at write time
    assert gate.seen == []
    gate.release.set()
    monitor.close()
    assert [(e.name, e.value, e.step) for e in gate.seen] == [("a", 1.5, 1), ("a", 2.5, 2)]
    assert _read_csv(tmp_path / "DeepSpeedJobName")["a.csv"] == (
        ["step", "a"],
        [(1, 1.5), (2, 2.5)],
    )


class _Batches:
    """A backend that keeps every batch it is given, as it is given."""

    def __init__(self) -> None:
        self.batches: list[list[tuple[str, float, int]]] = []

    def write(self, events: Any) -> None:
        self.batches.append([(e.name, e.value, e.step) for e in events])

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_staged_values_of_every_dtype_arrive_exact(tmp_path: Path) -> None:
    """Events written within the interval reach the writer as one batch (at the latest on
    flush), their tensor values stacked per dtype and read back exactly."""
    config = CSVMonitorConfig(enabled=True, output_path=str(tmp_path))
    monitor = MonitorMaster(csv_monitor=config, write_interval=3600.0)
    sink = _Batches()
    monitor.backends.append(sink)
    monitor.write_events([("a", torch.tensor(0.25), 1)])  # the first write goes at once
    big = 2**40 + 1  # exact only if int64 values are not squeezed through a float32
    monitor.write_events([("a", torch.tensor([1.5]), 2), ("n", torch.tensor(big), 2)])
    half = torch.tensor(0.1, dtype=torch.bfloat16)
    monitor.write_events([("h", half, 3), ("x", 7, 3), ("f", torch.tensor(2.0**-20), 3)])
    monitor.flush()
    later = [("a", 1.5, 2), ("n", float(big), 2), ("h", float(half), 3), ("x", 7.0, 3)]
    later.append(("f", 2.0**-20, 3))
    assert sink.batches[-1][-len(later) :] == later  # staged together until the flush
    assert [e for b in sink.batches for e in b] == [("a", 0.25, 1), *later]
    monitor.close()


def test_wandb_logs_one_row_per_step() -> None:
    """The events of a step go to W&B in one log call (one history row)."""
    calls: list[tuple[dict[str, float], int]] = []

    class Run:
        def log(self, row: dict[str, float], step: int) -> None:
            calls.append((row, step))

    backend = WandbMonitor.__new__(WandbMonitor)  # no wandb needed for the grouping
    backend.run = Run()
    backend.write(
        [
            ScalarEvent("a", 1.0, 4, 0.0),
            ScalarEvent("b", 2.0, 4, 0.0),
            ScalarEvent("a", 3.0, 8, 1.0),
        ]
    )
    assert calls == [({"a": 1.0, "b": 2.0}, 4), ({"a": 3.0}, 8)]


def test_bad_events_and_writer_failures_are_errors(tmp_path: Path) -> None:
    monitor = MonitorMaster(csv_monitor=CSVMonitorConfig(enabled=True, output_path=str(tmp_path)))
    with pytest.raises(ValueError, match=r"monitor event 'x': value is a tensor of shape \(2,\)"):
        monitor.write_events([("x", torch.ones(2), 1)])
    with pytest.raises(ValueError, match=r"step 1\.5 must be an integer"):
        monitor.write_events([("x", 1.0, 1.5)])
    with pytest.raises(ValueError, match=r"expected a \(name, value, step\) tuple"):
        monitor.write_events([("x", 1.0)])
    (tmp_path / "DeepSpeedJobName" / "blocked.csv").mkdir()  # the file cannot be opened
    monitor.write_events([("blocked", 1.0, 1)])
    with pytest.raises(RuntimeError, match=r"monitor failed while writing events.*blocked\.csv"):
        monitor.flush()
    monitor.close()
    with pytest.raises(RuntimeError, match="after the monitor was closed"):
        monitor.write_events([("x", 1.0, 2)])
    # Other ranks own no backend and write nothing.
    other = MonitorMaster(csv_monitor=CSVMonitorConfig(enabled=True, output_path="x"), rank=1)
    assert other.enabled and not other.active and not other.backends
    other.write_events([("x", 1.0, 1)])


def test_missing_package_names_the_pip_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "comet_ml", None)
    with pytest.raises(ImportError, match=r"'comet\.enabled' is true .*pip install comet_ml"):
        MonitorMaster(comet=CometConfig(enabled=True), rank=0)


def _cfg(**extra: Any) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": 2, **extra}


def test_config_blocks_typed_and_strict() -> None:
    cfg = parse_config(
        _cfg(
            tensorboard={"enabled": True, "output_path": "logs/", "job_name": "run"},
            csv_monitor={"enabled": True},
            wandb={"enabled": False, "group": "g", "team": "t", "project": "p"},
            comet={"enabled": False, "samples_log_interval": 10, "mode": "create"},
        )
    )
    assert cfg.tensorboard.job_name == "run" and cfg.csv_monitor.job_name == "DeepSpeedJobName"
    assert cfg.wandb.project == "p" and cfg.comet.mode == "create"
    assert not parse_config(_cfg(comet=None)).comet.enabled
    with pytest.raises(ConfigError, match=r"tensorboard.*jobname.*job_name"):
        parse_config(_cfg(tensorboard={"enabled": True, "jobname": "x"}))
    with pytest.raises(ConfigError, match=r"csv_monitor\.output_path' = 3"):
        parse_config(_cfg(csv_monitor={"enabled": True, "output_path": 3}))
    with pytest.raises(ConfigError, match=r"comet\.mode' = 'always'"):
        parse_config(_cfg(comet={"mode": "always"}))
    with pytest.raises(ConfigError, match=r"wandb\.enabled' = 1"):
        parse_config(_cfg(wandb={"enabled": 1}))


def test_wandb_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real offline W&B run holds the logged scalar names (skipped without wandb)."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monitor = MonitorMaster(wandb=WandbConfig(enabled=True, project="proj", group="grp"), rank=0)
    run = monitor.backends[0].run  # type: ignore[attr-defined]
    assert (run.project, run.group) == ("proj", "grp")
    monitor.write_events([("Train/Samples/lr", 0.5, 8), ("Train/Samples/train_loss", 2.0, 8)])
    monitor.close()
    (record,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    data = record.read_bytes()
    assert b"Train/Samples/lr" in data and b"Train/Samples/train_loss" in data
    assert os.environ["WANDB_MODE"] == "offline"
