"""A NaN/inf loss in fp32 or bf16 (ZeRO 0, 2, 3; 2 gloo ranks) is skipped on every rank, or
raises on every rank with ``nonfinite_gradients: "error"`` — never applied, never a hang."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.distributed.harness import run_world
from tests.runtime import _nonfinite_workloads as w

SKIP_CASES = [
    ("fp32", 0, "one"),
    ("fp32", 3, "one"),
    ("bf16", 0, "one"),
    ("bf16", 3, "one"),
    ("bf16", 2, "all"),
    ("fp32", 3, "inf"),
    ("fp32", 1, "one", "tp"),
    ("bf16", 1, "one", "pp"),
]
ERROR_CASES = [("fp32", 0), ("bf16", 3)]


@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    """Both ranks' results. A rank that does not raise while the other does would hang in the
    next collective: the harness kills a world still running after 240 s, so that fails
    (TimeoutError) instead of hanging."""
    return {"ranks": run_world(w.all_cases, 2, SKIP_CASES, ERROR_CASES, timeout_s=240)}


def _case(results: dict[str, Any], kind: str, case: tuple[Any, ...]) -> list[dict[str, Any]]:
    return [r[kind][case] for r in results["ranks"]]


@pytest.mark.parametrize("case", SKIP_CASES, ids=lambda c: "-".join(map(str, c)))
def test_nonfinite_step_is_skipped_on_every_rank(results, case):
    """The poisoned step changes nothing (masters, parameters, optimizer states, lr) on any
    rank, counts as skipped, and the run then equals a clean run without that step."""
    for r in _case(results, "skip", case):
        bad, clean = r["poisoned"], r["clean"]
        assert bad["applied"] == [True, False, True, True]
        assert bad["bad_step_unchanged"]
        assert bad["skipped"] == 1 and bad["global_steps"] == 4
        # The lr schedule does not advance on a skipped step (DeepSpeed's behaviour).
        assert bad["lrs"][1] == bad["lrs"][0]
        assert bad["lrs"][2:] == clean["lrs"][1:]
        assert all(torch.isfinite(m).all() for m in bad["final"])
        for a, b in zip(bad["final"], clean["final"]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        assert bad["losses"][3] == pytest.approx(clean["losses"][2], rel=1e-5)


@pytest.mark.parametrize("case", SKIP_CASES, ids=lambda c: "-".join(map(str, c)))
def test_skip_warning_names_step_and_norm_without_loss_scale(results, case):
    """Rank 0 warns once, naming the step (2) and the norm; no loss scale outside fp16.
    A rank whose own loss was non-finite says so."""
    rank0, rank1 = _case(results, "skip", case)
    skips = [w for w in rank0["poisoned"]["warnings"] if "skipped" in w]
    assert len(skips) == 1, rank0["poisoned"]["warnings"]
    assert skips[0].startswith("step 2 skipped: the global gradient norm is ")
    assert ("inf" in skips[0]) or ("nan" in skips[0])
    assert "loss scale" not in skips[0]
    assert not [w for w in rank1["poisoned"]["warnings"] if "skipped" in w]
    poisoned_ranks = [0, 1] if case[2] != "one" else [1]
    if case[3:] == ("pp",):
        poisoned_ranks = [0, 1]  # train_batch's loss is broadcast from the last stage
    for rank, r in enumerate((rank0, rank1)):
        hint = [w for w in r["poisoned"]["warnings"] if w.startswith(f"rank {rank}: ")]
        assert bool(hint) == (rank in poisoned_ranks)
        if hint:
            assert "before step 2 is" in hint[0]


@pytest.mark.parametrize("case", ERROR_CASES, ids=lambda c: "-".join(map(str, c)))
def test_error_mode_raises_on_every_rank_without_applying(results, case):
    """With a nan loss on rank 1 only, both ranks raise at the same step; nothing applied."""
    for r in _case(results, "error", case):
        assert r["at"] == 1
        assert r["unchanged"]
        assert r["error"].startswith("step 2: the global gradient norm is nan")
        assert '"nonfinite_gradients": "skip"' in r["error"]
        assert r["skipped"] == 1 and r["global_steps"] == 2
