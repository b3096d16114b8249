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
