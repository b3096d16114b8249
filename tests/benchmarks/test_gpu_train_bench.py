"""benchmarks/gpu_train.py's code paths on tiny models on the CPU (``--dry-run``): every row
trains and reports, the offload row through the offload step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_dry_run_reports_every_row(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "benchmarks.gpu_train", "--dry-run", "--backend", "eager"]
    cmd += ["--models", "gpt-1b", "--no-deepspeed", "--steps", "1", "--warmup", "1"]
    cmd += ["--out", str(tmp_path)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads((tmp_path / "summary.json").read_text())["rows"]
    names = [(r["model"], r["name"]) for r in rows]
    assert names == [
        ("gpt-1b", "slipstream"),
        ("gpt-1b", "torch-amp"),
        ("gpt-1b", "torch-bf16"),
        ("gpt-3b", "slipstream-offload"),
    ]
    for r in rows:
        assert not r["error"], r
        assert r["tokens_per_s"] > 0 and 0 < r["loss"] < 10, r
    assert "MFU" in done.stdout and "slipstream-offload" in done.stdout
