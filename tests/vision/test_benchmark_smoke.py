"""benchmarks/apf.py runs end to end at toy sizes and reports every section."""

from __future__ import annotations

import pytest


def test_apf_benchmark_runs_all_sections_at_toy_size() -> None:
    """Every section returns rows with positive timings and token ratios >= 1."""
    pytest.importorskip("skimage")
    from benchmarks.apf import main

    out = main(
        ["--sizes", "128", "--length", "16", "--patch", "4", "--sections", "tokens,time,prep,dice",
         "--max-measured", "256", "--prep-models", "tiny", "--dice-steps", "2", "--dice-batch", "2",
         "--dice-images", "2,1", "--reps", "1"]
    )  # fmt: skip
    assert {r["variant"] for r in out["tokens"]} == {"threshold", "fixed_length"}
    assert all(r["ratio"] >= 1 for r in out["tokens"])
    assert out["time"][0]["speedup"] > 1 and out["prep"][0]["step_s"] > 0
    assert [r["dtype"] for r in out["prep"]] == ["float32", "uint8"]
    assert all(r["prep_s"] > 0 for r in out["prep"])
    assert [r["arm"] for r in out["dice"]] == ["uniform", "apf"]
    assert all(0 <= r["dice"] <= 1 for r in out["dice"])
