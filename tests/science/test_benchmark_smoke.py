"""benchmarks/evoformer.py runs end to end at a tiny shape and reports a lower tiled peak."""

from __future__ import annotations

from benchmarks.evoformer import format_table, main


def test_benchmark_tiny_shape() -> None:
    """Naive and one tiled config are timed and measured; DeepSpeed's row says why it is absent."""
    rows = main(["--n-seq", "2", "--lengths", "64", "--heads", "2", "--dim", "8", "--reps", "2",
                 "--tiles", "16x16x1"])  # fmt: skip
    by_name = {r.name: r for r in rows}
    naive, tiled = by_name["naive"], by_name["tiled 16x16x1"]
    assert len(naive.step_ms) == len(tiled.step_ms) == 2 and min(tiled.step_ms) > 0
    assert 0 < tiled.step_peak_bytes < naive.step_peak_bytes
    assert by_name["deepspeed"].error.startswith("unavailable")
    assert "naive/mem" in format_table(rows)
