"""``deepspeed.monitor``'s classes write what DeepSpeed 0.19.8's write: events through
``MonitorMaster`` land in the CSV files and the TensorBoard event file, read back here and
compared with what DeepSpeed 0.19.8 wrote for the same calls on this machine (its CSV rows
and scalars, except that DeepSpeed writes a tensor value as ``tensor(1.2500)`` and an int as
``3``); ``enabled`` and rank 0 gate the writing as in DeepSpeed."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

import _slipstream_as_deepspeed as alias
from slipstream.config import ConfigError
from slipstream.monitor.config import DeepSpeedMonitorConfig, get_monitor_config
from slipstream.monitor.csv_monitor import csvMonitor
from slipstream.monitor.monitor import MonitorMaster
from slipstream.monitor.tensorboard import TensorBoardMonitor
from slipstream.monitor.wandb import WandbMonitor
from slipstream.runtime.config import DeepSpeedConfig

EVENTS = [
    [("Train/Samples/loss", 1.5, 2), ("Train/Samples/lr", 0.001, 2)],
    [("Train/Samples/loss", torch.tensor(1.25), 4), ("eval acc", 3, 4)],
]
# What DeepSpeed 0.19.8 wrote for EVENTS (its CSV values as floats).
DEEPSPEED_CSV = {
    "Train_Samples_loss.csv": ("loss", [(2, 1.5), (4, 1.25)]),
    "Train_Samples_lr.csv": ("lr", [(2, 0.001)]),
    "eval_acc.csv": ("eval acc", [(4, 3.0)]),
}
DEEPSPEED_TB = {
    "Train/Samples/loss": [(2, 1.5), (4, 1.25)],
    "Train/Samples/lr": [(2, 0.0010000000474974513)],
    "eval acc": [(4, 3.0)],
}


def _config(out: Path, **extra: object) -> dict:
    return {
        "train_batch_size": 1,
        "tensorboard": {"enabled": True, "output_path": str(out), "job_name": "tb"},
        "csv_monitor": {"enabled": True, "output_path": str(out), "job_name": "csv"},
        **extra,
    }


def _read_csv(path: Path) -> tuple[str, list[tuple[int, float]]]:
    rows = list(csv.reader(path.open()))
    return rows[0][1], [(int(s), float(v)) for s, v in rows[1:]]


def test_deepspeed_paths_are_these_modules() -> None:
    for name in ("monitor", "tensorboard", "csv_monitor", "wandb", "comet", "config"):
        assert alias._target(f"deepspeed.monitor.{name}") == f"slipstream.monitor.{name}"


def test_master_writes_deepspeeds_csv_and_tensorboard_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("RANK", "0")
    config = DeepSpeedConfig(_config(tmp_path)).monitor_config
    master = MonitorMaster(config)
    assert master.enabled and master.tb_monitor is not None and master.wandb_monitor is None
    for events in EVENTS:
        master.write_events(events)
    # Synchronous, as DeepSpeed's: everything is on disk when write_events returns.
    got = {p.name: _read_csv(p) for p in sorted((tmp_path / "csv").glob("*.csv"))}
    assert got == DEEPSPEED_CSV
    assert master.csv_monitor is not None
    assert master.csv_monitor.filenames == ["Train_Samples_loss", "Train_Samples_lr", "eval_acc"]
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    scalars = {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}
    assert scalars == DEEPSPEED_TB
    with pytest.raises(ValueError, match="step"):
        master.write_events([("x", 1.0, "two")])


def test_enabled_and_rank_gate_writing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    csv_block = get_monitor_config(_config(tmp_path)).csv_monitor
    mon = csvMonitor(csv_block)
    mon.enabled = False  # DeepSpeed checks enabled at every write
    mon.write_events(EVENTS[0])
    assert not list((tmp_path / "csv").glob("*.csv"))
    # Rank 1: patched where MonitorMaster reads it (an earlier test of this process may have
    # left a default process group, whose rank wins over $RANK).
    monkeypatch.setattr("slipstream.monitor.monitor.global_rank", lambda: 1)
    other = MonitorMaster(get_monitor_config(_config(tmp_path / "r1")))
    assert other.enabled and other.csv_monitor is None and other.tb_monitor is None
    other.write_events(EVENTS[0])
    assert not (tmp_path / "r1").exists()
    off = MonitorMaster(DeepSpeedMonitorConfig())
    assert not off.enabled
    # A disabled block builds its monitor without its library, with the block's values.
    wandb = WandbMonitor(get_monitor_config({"wandb": {"project": "p", "team": "t"}}).wandb)
    assert (wandb.enabled, wandb.project, wandb.team, wandb.group) == (False, "p", "t", None)
    assert wandb.log({"a": 1.0}) is None
    tb = TensorBoardMonitor(DeepSpeedMonitorConfig().tensorboard)
    assert (tb.enabled, tb.output_path, tb.job_name) == (False, "", "DeepSpeedJobName")
    assert tb.summary_writer is None


def test_unknown_monitor_key_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"csv_monitor\.outptu_path"):
        get_monitor_config({"csv_monitor": {"enabled": True, "outptu_path": "x"}})
