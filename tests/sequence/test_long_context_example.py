"""examples/long_context.py: a sequence over a 12 MiB budget alone fits it with SP=2, and trains."""

from __future__ import annotations

import re
from pathlib import Path

from tests.distributed.harness import run_cli

ROOT = Path(__file__).resolve().parents[2]


def test_long_context_example_fits_with_sp_only():
    proc = run_cli(
        ["run", "--nproc", "2", str(ROOT / "examples" / "long_context.py"), "--seq", "512",
         "--layers", "1", "--steps", "1", "--budget-mib", "12"],
        cwd=ROOT, timeout_s=240,
    )  # fmt: skip
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-3000:]
    alone, sharded = (float(v) for v in re.findall(r"peak\s+([\d.]+) MiB", text))
    assert sharded < 0.6 * alone, text
    assert re.search(r"whole sequence: .*does NOT fit", text), text
    assert re.search(r"2 processes, ulysses: .*-> fits", text), text
    assert "step 1: loss" in text
