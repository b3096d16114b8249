"""examples/apf_segmentation.py runs end to end at toy size and prints both arms."""

from __future__ import annotations

from pathlib import Path

from tests.distributed.harness import run_script

ROOT = Path(__file__).resolve().parents[2]


def test_apf_example_runs_at_toy_size() -> None:
    args = ["--image-size", "128", "--length", "16", "--steps", "2", "--train-images", "2",
            "--test-images", "1", "--batch", "2", "--threads", "1"]  # fmt: skip
    proc = run_script(ROOT / "examples" / "apf_segmentation.py", *args, cwd=ROOT, timeout_s=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = [
        line.split()
        for line in proc.stdout.splitlines()
        if line.startswith(("uniform", "adaptive"))
    ]
    assert [r[0] for r in rows] == ["uniform", "adaptive"]
    assert all(0.0 <= float(r[-2]) <= 1.0 and 0.0 <= float(r[-1]) <= 1.0 for r in rows)  # Dice
