"""`slipstream demo` trains on 2 launched processes, reports a loss drop and samples text."""

from __future__ import annotations

import re
from pathlib import Path

from tests.distributed.harness import run_cli

ROOT = Path(__file__).resolve().parents[2]


def test_demo_tiny_runs_end_to_end(tmp_path: Path) -> None:
    """... and leaves its curves (CSV monitor, PNG plots) and the FLOPs profile in --run-dir."""
    run = tmp_path / "run"
    proc = run_cli(
        ["demo", "--preset", "tiny", "--steps", "30", "--seq-len", "64", "--sample-tokens", "20",
         "--nproc", "2", "--run-dir", str(run)],
        cwd=ROOT, timeout_s=180,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "world 2, ZeRO-3" in out
    match = re.search(r"validation loss ([\d.]+) -> ([\d.]+)", out)
    assert match, out[-2000:]
    before, after = float(match.group(1)), float(match.group(2))
    assert after < before - 0.5, (before, after)
    assert "sample:\ndef " in out
    assert (run / "plots" / "summary.png").is_file()
    assert (run / "demo" / "Train_Samples_train_loss.csv").is_file()
    assert (run / "demo" / "Train_Samples_mfu.csv").is_file()
    assert "Profile summary at step 2" in (run / "flops_profile.txt").read_text()
