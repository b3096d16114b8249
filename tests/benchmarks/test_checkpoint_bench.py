"""Smoke test of benchmarks/checkpoint.py: ``--quick`` for slipstream alone, as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_run_prints_a_row_per_stage_with_exact_reload(tmp_path: Path) -> None:
    """--quick saves and loads at ZeRO 2 and 3, reloads bit-exactly and reports sane figures."""
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "checkpoint.py"),
            "--quick",
            "--frameworks",
            "slipstream",
            "--dir",
            str(tmp_path),
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines() if line.strip()}
    for name in ("slipstream-z2", "slipstream-z3"):
        assert name in rows, proc.stdout
        assert rows[name][9] == "exact", rows[name]
    assert "page cache" in proc.stdout
    results = {r["name"]: r for r in json.loads(out.read_text())["results"]}
    for result in results.values():
        assert 0 < result["save_s"] < 60 and 0 < result["load_s"] < 60
        assert result["checkpoint_bytes"] > 0 and result["checkpoint_files"] >= 4
        assert result["max_loss_error"] == 0.0
        assert len(result["ranks"]) == 2
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]  # checkpoints removed
