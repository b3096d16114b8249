"""Checkpoint faults: a save killed after any filesystem step (tag reuse included) leaves the
old or the new checkpoint loadable and its leftovers are cleaned; a failure on one rank
reaches every rank at once; damaged manifests and ``latest`` files are named."""

from __future__ import annotations

from typing import Any

import pytest

from tests.checkpoint import _fault_workloads as w
from tests.distributed.harness import run_world


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    (result,) = run_world(w.single_process, 1, str(tmp_path_factory.mktemp("single")))
    return result


@pytest.fixture
def crashes(single: dict[str, Any]) -> dict[str, Any]:
    return single["crashes"]


@pytest.fixture
def damaged(single: dict[str, Any]) -> dict[str, Any]:
    return single["damage"]


@pytest.mark.parametrize("mode", ["exchange", "two_renames"])
def test_tag_reuse_save_stopped_after_any_step_loads_old_or_new(crashes, mode):
    """After a crash at every point: ``latest`` loads the old or the new ``A`` (never an
    error), the next save leaves no hidden leftovers, and ``A`` still loads."""
    points, runs = crashes[mode]["points"], crashes[mode]["runs"]
    expected = {"commit.exchanged"} if mode == "exchange" else {"commit.moved_old"}
    assert expected <= set(points) and "retain.half_removed" in points, points
    assert len(runs) == len(points) >= 12
    seen = set()
    for run in runs:
        assert run["load"].startswith("loaded A"), run
        assert run["state"] in ("old", "new") and run["state_again"] == run["state"], run
        assert f"'v': '{run['state']}'" in run["load"], run
        assert run["leftovers"] == [], run
        assert run["reload"] == run["load"], run
        seen.add(run["state"])
    assert seen == {"old", "new"}  # crashes before and after the commit point


def test_edited_or_damaged_manifest_is_refused_naming_the_file(damaged):
    assert damaged["has_digest"]
    assert "b/manifest.json was edited or damaged after it was written" in damaged["edited"]
    assert "b/manifest.json is damaged (not valid UTF-8 JSON" in damaged["damaged"]
    assert damaged["legacy"].startswith("loaded b"), "a version-1 manifest without digest loads"
    # Issue 38: deleting the digest of a current manifest does not make it load unchecked.
    assert (
        "b/manifest.json was edited or damaged after it was written: it has no "
        "manifest_sha256" in damaged["no_digest"]
    )


def test_empty_or_wrong_latest_names_the_problem_and_the_tags(damaged):
    assert "latest is empty" in damaged["empty_latest"]
    assert "tags present (oldest first): ['a', 'b']" in damaged["empty_latest"]
    assert (
        "/gone (named by" in damaged["missing_tag"] and "does not exist" in damaged["missing_tag"]
    )
    assert "['a', 'b']" in damaged["missing_tag"]
    assert damaged["no_latest"] == (None, None)


def test_next_save_cleans_stale_leftovers_but_not_a_live_save_or_user_files(damaged):
    assert damaged["after_clean"] == [
        ".d.tmp-fedcba987654",
        ".save-00000000000a.lock",
        ".save-fedcba987654.lock",
        "a",
        "b",
        "c",
        "latest",
        "notes",
    ]


def test_a_failure_on_one_rank_reaches_every_rank_at_once(tmp_path):
    """2 ranks, the script catches the errors and goes on to a barrier: ENOSPC on rank 0 while
    committing the manifest, a corrupted file only rank 1 reads, a read error on rank 1 while
    restoring at ZeRO-3: both ranks raise an error naming the failing rank within seconds
    (a hang would last until the collective timeout, minutes)."""
    results = run_world(w.one_rank_failures, 2, str(tmp_path))
    for r in results:
        assert "committing (manifest, rename, 'latest') failed on rank 0:" in r["save"], r
        assert "No space left on device" in r["save"]
        assert "verifying the files failed on rank 1:" in r["load"], r
        assert "good/rank-00001.pt is corrupted" in r["load"]
        assert "restoring the state failed on rank 1: OSError" in r["restore"], r
        assert max(r["save_s"], r["load_s"], r["restore_s"]) < 60
        assert r["final"].endswith("good2")
        assert r["differs_logged"] == []
    assert results[0]["after_failed_save"] == [], "the failed save must leave nothing behind"
