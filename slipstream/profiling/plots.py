"""Run plots: the scalars a run's monitors wrote (CSV or TensorBoard) as PNG curves.

``slipstream plot RUN_DIR`` finds every ``csv_monitor`` file (``<job>/<Name>.csv`` with a
``step,<name>`` header), every TensorBoard event file and every JSON-lines metrics file (one
object per line with a ``step`` key, as the RLHF trainers and ``slipstream chat`` write)
under ``RUN_DIR``, and draws one PNG per scalar plus ``summary.png`` with the curves a run is
judged by (RLHF reward and KL; loss, learning rate, throughput, MFU, gradient norm) side by
side. The x axis is the event step (the
engine's events use samples seen, as DeepSpeed's do).
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["SUMMARY_KEYS", "plot_run", "read_scalars"]

Series = list[tuple[float, float]]

# Fragments of scalar names shown in summary.png, in this order (first match per panel).
SUMMARY_KEYS = (
    "reward_mean",
    "kl",
    "train_loss",
    "loss",
    "lr",
    "tokens_per_sec",
    "samples_per_sec",
    "mfu",
    "grad_norm",
)


def read_scalars(run_dir: str | Path) -> dict[str, Series]:
    """Every scalar under ``run_dir``: name -> sorted ``(step, value)`` points.

    CSV files are named by the file (``Train_Samples_lr``); TensorBoard tags keep their names
    (``Train/Samples/lr``); a JSON-lines file gives ``<file stem>/<key>`` for each numeric key
    (``ppo/reward_mean``). When both hold a scalar, both are returned under their own names.
    """
    root = Path(run_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"slipstream plot: {root} is not a directory")
    scalars: dict[str, Series] = {}
    for path in sorted(root.rglob("*.csv")):
        series = _read_csv(path)
        if series is not None:
            scalars[path.stem] = series
    for path in sorted(root.rglob("events.out.tfevents.*")):
        scalars.update(_read_tensorboard(path))
    for path in sorted(root.rglob("*.jsonl")):
        scalars.update(_read_jsonl(path))
    return scalars


def _read_jsonl(path: Path) -> dict[str, Series]:
    """A JSON-lines metrics file: every numeric (not boolean) key of objects that have a
    ``step``; other files and lines (a line cut short by a crash) are skipped."""
    out: dict[str, Series] = {}
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(row, dict) or not isinstance(row.get("step"), (int, float)):
            continue
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                out.setdefault(f"{path.stem}/{key}", []).append((float(row["step"]), float(value)))
    return {name: sorted(points) for name, points in out.items()}


def _read_csv(path: Path) -> Series | None:
    """A csv_monitor file, or None for any other CSV (the header must start with ``step``)."""
    with open(path, newline="") as handle:
        rows = list(csv.reader(handle))
    if not rows or len(rows[0]) != 2 or rows[0][0] != "step":
        return None
    points = []
    for row in rows[1:]:
        try:
            points.append((float(row[0]), float(row[1])))
        except (ValueError, IndexError):
            continue  # a line cut short by a crash: keep the rest
    return sorted(points)


def _read_tensorboard(path: Path) -> dict[str, Series]:
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError as e:
        raise ImportError(
            f"slipstream plot: {path} is a TensorBoard event file; reading it needs the "
            "tensorboard package: pip install tensorboard"
        ) from e
    acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
    acc.Reload()
    return {
        tag: sorted((float(e.step), float(e.value)) for e in acc.Scalars(tag))
        for tag in acc.Tags()["scalars"]
    }


def _file_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) + ".png"


def _summary(scalars: dict[str, Series]) -> list[str]:
    chosen: list[str] = []
    for key in SUMMARY_KEYS:
        match = next(
            (n for n in sorted(scalars) if n.lower().endswith(key) and n not in chosen), None
        )
        if match is not None and not (key == "loss" and any("loss" in c for c in chosen)):
            chosen.append(match)
    return chosen


def plot_run(
    run_dir: str | Path, out_dir: str | Path | None = None, summary_only: bool = False
) -> list[Path]:
    """Write one PNG per scalar (unless ``summary_only``) and ``summary.png`` to ``out_dir``
    (default ``RUN_DIR/plots``); returns the files written.

    Raises:
        FileNotFoundError: ``run_dir`` is missing or holds no monitor scalars.
        ImportError: matplotlib (or tensorboard, for event files) is not installed.
    """
    scalars = read_scalars(run_dir)
    if not scalars:
        raise FileNotFoundError(
            f"slipstream plot: no monitor scalars under {run_dir} (looked for csv_monitor "
            "files with a 'step,<name>' header, TensorBoard event files and JSON-lines files "
            "with a 'step' key); enable csv_monitor or tensorboard in the config"
        )
    plt = _pyplot()
    out = Path(out_dir) if out_dir is not None else Path(run_dir) / "plots"
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, series in [] if summary_only else sorted(scalars.items()):
        fig, ax = plt.subplots(figsize=(5, 3.2))
        _draw(ax, name, series)
        fig.tight_layout()
        written.append(out / _file_name(name))
        fig.savefig(written[-1], dpi=100)
        plt.close(fig)
    panels = _summary(scalars)
    if panels:
        cols = min(3, len(panels))
        rows = math.ceil(len(panels) / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.2 * rows), squeeze=False)
        for ax, name in zip(axes.flat, panels):
            _draw(ax, name, scalars[name])
        for ax in list(axes.flat)[len(panels) :]:
            ax.set_visible(False)
        fig.tight_layout()
        written.append(out / "summary.png")
        fig.savefig(written[-1], dpi=100)
        plt.close(fig)
    return written


def _draw(ax: Any, name: str, series: Iterable[tuple[float, float]]) -> None:
    points = list(series)
    steps = [s for s, _ in points]
    values = [v for _, v in points]
    ax.plot(steps, values, linewidth=1.2)
    ax.set_title(name, fontsize=9)
    ax.set_xlabel("samples" if "samples" in name.lower() else "step", fontsize=8)
    ax.grid(alpha=0.3)
    if name.lower().endswith("loss") and values and min(values) > 0:
        ax.set_yscale("log")


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError(
            "slipstream plot needs matplotlib: pip install matplotlib (or slipstream[plot])"
        ) from e
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt
