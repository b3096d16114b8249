"""Runnable examples run as documented (through the launcher)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_zero3_example_through_launcher(tmp_path):
    out = tmp_path / "export"
    proc = subprocess.run(
        [sys.executable, "-m", "slipstream.cli.main", "run", "--nproc", "2",
         str(ROOT / "examples" / "zero3_gpt.py"), "--out", str(out), "--steps", "10"],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
    )  # fmt: skip
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-3000:]
    assert "final loss" in text and "exported to" in text
    assert (out / "model.safetensors.index.json").is_file()
