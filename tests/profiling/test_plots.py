"""``slipstream plot``: the scalars the monitors wrote (CSV and TensorBoard) come back exactly
and become readable PNG curves; a directory without scalars is a clear error."""

from __future__ import annotations

import json
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


def test_json_lines_metrics_are_read_and_summarized_as_reward_and_kl(tmp_path, capsys):
    """The RLHF trainers' JSON-lines files: numeric keys per step (booleans, nulls and
    torn lines skipped); ``summary.png`` leads with reward and KL."""
    rows = [{"step": s, "reward_mean": 0.1 * s, "kl": 0.01 * s, "reused_batch": False,
             "ptx_loss": None, "actor_loss": 1.0 / s} for s in (2, 1, 3)]  # fmt: skip
    lines = [json.dumps(r) for r in rows] + ['{"step": 4, "reward_me']
    (tmp_path / "ppo.jsonl").write_text("\n".join(lines))
    scalars = read_scalars(tmp_path)
    assert sorted(scalars) == ["ppo/actor_loss", "ppo/kl", "ppo/reward_mean"]
    assert scalars["ppo/reward_mean"] == [(1.0, 0.1), (2.0, 0.2), (3.0, 0.1 * 3)]
    assert main_plot(tmp_path) == 0
    out = capsys.readouterr().out.split()
    assert out[-1].endswith("summary.png") and _is_a_plot(Path(out[-1]))
    assert plot_run(tmp_path, tmp_path / "only", summary_only=True) == [
        tmp_path / "only" / "summary.png"
    ]


def main_plot(run: Path) -> int:
    return cli_main(["plot", str(run)])
