"""Smoke test of benchmarks/heat.py on a tiny synthetic data set."""

from __future__ import annotations

from benchmarks.heat import format_table, run
from slipstream.recsys import SimpleXConfig, numba_available, synthetic_interactions


def test_benchmark_runs_every_runner_and_prints_ratios() -> None:
    """One epoch of each runner (1 thread: CI-sized) gives timed rows, metrics for the trained
    ones (NaN for timed-only rows) and a table with ratios."""
    split = synthetic_interactions(60, 80, 1200, num_clusters=2, seed=0)
    cfg = SimpleXConfig(embedding_dim=16, num_negatives=8, max_history=20)
    rows = {
        r.name: r for r in run(split, cfg, epochs=1, threads=1, tile=(16, 32), log=lambda _: None)
    }
    expected = {"pytorch-1t", "heat-torch-1t", "popularity"}
    if numba_available():
        expected |= {"heat-numba-1t", "heat-numba-tile16/32-1t"}
    assert set(rows) == expected
    assert all(
        len(r.epoch_s) == 1 and r.epoch_s[0] > 0 for n, r in rows.items() if n != "popularity"
    )
    assert (
        0.0 <= rows["pytorch-1t"].recall <= 1.0
        and rows["heat-torch-1t"].recall != rows["heat-torch-1t"].recall
    )
    table = format_table(list(rows.values()))
    assert "| pytorch-1t | 1 |" in table and "1.0x" in table
