"""benchmarks/gpu_train.py's code paths on tiny models on the CPU (``--dry-run``): every row
trains and reports, the offload row through the offload step."""

from __future__ import annotations

import json
from pathlib import Path

from tests.distributed.harness import run_script

ROOT = Path(__file__).resolve().parents[2]


def test_dry_run_reports_every_row(tmp_path: Path) -> None:
    args = ["--dry-run", "--backend", "eager", "--models", "gpt-1b", "--no-deepspeed"]
    args += ["--steps", "1", "--warmup", "1", "--out", str(tmp_path)]
    done = run_script("benchmarks.gpu_train", *args, module=True, cwd=ROOT, timeout_s=240)
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
