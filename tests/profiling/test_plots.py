"""``slipstream plot``: the scalars the monitors wrote (CSV and TensorBoard) come back exactly
and become readable PNG curves; a directory without scalars is a clear error."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from slipstream.cli.main import main as cli_main
from slipstream.config.monitor import CSVMonitorConfig, TensorBoardConfig
from slipstream.profiling import MonitorMaster
from slipstream.profiling.plots import plot_run, read_scalars

pytest.importorskip("matplotlib")
Image = pytest.importorskip("PIL.Image")

EVENTS = [
    *[("Train/Samples/train_loss", 5.0 * math.exp(-s / 40), 8 * s) for s in range(1, 60)],
    *[("Train/Samples/lr", 1e-3 * min(1.0, s / 10), 8 * s) for s in range(1, 60)],
    *[("Train/Samples/mfu", 30.0 + (s % 5), 8 * s) for s in range(1, 60)],
]


def _write(run: Path, tensorboard: bool) -> None:
    monitor = MonitorMaster(
        csv_monitor=CSVMonitorConfig(enabled=True, output_path=str(run), job_name="job"),
        tensorboard=TensorBoardConfig(enabled=tensorboard, output_path=str(run), job_name="tb")
        if tensorboard
        else None,
        rank=0,
    )
    monitor.write_events(EVENTS)
    monitor.close()


def _is_a_plot(path: Path) -> bool:
    with Image.open(path) as image:
        colours = image.convert("RGB").getcolors(maxcolors=1 << 16)
        return image.size[0] > 200 and (colours is None or len(colours) > 2)


def test_csv_and_tensorboard_scalars_round_trip_and_plot(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    _write(tmp_path, tensorboard=True)
    scalars = read_scalars(tmp_path)
    steps = [float(s) for n, _, s in EVENTS if n == "Train/Samples/lr"]
    values = [v for n, v, _ in EVENTS if n == "Train/Samples/lr"]
    for name, rel in (("Train_Samples_lr", 1e-12), ("Train/Samples/lr", 1e-6)):  # CSV, events
        assert [s for s, _ in scalars[name]] == steps
        assert [v for _, v in scalars[name]] == pytest.approx(values, rel=rel)
    written = plot_run(tmp_path)
    names = {p.name for p in written}
    assert {"Train_Samples_train_loss.png", "Train_Samples_mfu.png", "summary.png"} <= names
    assert all(_is_a_plot(p) for p in written)
    assert all(p.parent == tmp_path / "plots" for p in written)


def test_cli_writes_plots_and_refuses_an_empty_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _write(tmp_path / "run", tensorboard=False)
    assert cli_main(["plot", str(tmp_path / "run"), "--out", str(tmp_path / "png")]) == 0
    assert (tmp_path / "png" / "summary.png").is_file()
    (tmp_path / "empty").mkdir()
    assert cli_main(["plot", str(tmp_path / "empty")]) == 2
    assert "no monitor scalars" in capsys.readouterr().err
