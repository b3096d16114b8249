"""Smoke test of the fault matrix (benchmarks/faults.py): one case in a real process (the
rest of what it injects is tested in-process by tests/checkpoint/test_faults.py)."""

from __future__ import annotations

from benchmarks.faults import CASES, format_table, run_cases


def test_fault_matrix_sigkill_between_the_renames_of_a_tag_reuse_loses_nothing():
    """The process is SIGKILLed between moving the old ``A`` aside and renaming the new one
    in; ``latest`` then loads the old ``A`` (recovered), every file verified."""
    assert {"reuse-kill", "rank0-manifest-enospc", "empty-latest"} <= set(CASES)
    (row,) = run_cases(["reuse-kill-2renames:commit.moved_old"], timeout_s=120)
    table = format_table([row])
    assert row.case == "reuse-kill-2renames:commit.moved_old" and row.case in table
    assert row.ok and not row.data_lost and row.seconds is None, table
    assert row.outcome == "killed; latest loads A (old)", table


def test_fault_matrix_runtime_rows_are_registered_and_the_config_row_runs():
    """The runtime rows (launcher, ranks, NaN, config, ZeRO-3, exit codes) are in the matrix;
    the config-type row (one plain process, no launcher) gives a clean error within a second."""
    assert {"launcher-sigkill", "rank-sigkill", "stalled-rank", "nan-loss-fp32"} <= set(CASES)
    assert {"config-type", "zero3-released", "exit-codes"} <= set(CASES)
    (row,) = run_cases(["config-type"], timeout_s=120)
    assert row.ok and row.seconds is not None and row.seconds < 1.0, format_table([row])
    assert "zero_optimization.stage" in row.outcome
