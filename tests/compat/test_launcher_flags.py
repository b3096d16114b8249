"""`slipstream run` with DeepSpeed's --bind_cores_to_rank/--bind_core_list and slipstream's
--as-deepspeed: real local launches at 2 ranks, and the refusals."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from slipstream.cli._binding import parse_core_list, plan_core_binding
from slipstream.cli._hostfile import LaunchError
from tests.distributed.harness import run_cli

REPO = Path(__file__).resolve().parents[2]
PROBE = str(Path(__file__).parent / "_scripts" / "probe_rank.py")


def _run(tmp_path: Path, *flags: str) -> dict[int, dict]:
    env = {k: v for k, v in os.environ.items() if k not in ("SLIPSTREAM_AS_DEEPSPEED",)}
    # The launcher forked warm (run_cli); its ranks start as new interpreters.
    proc = run_cli(["run", "--nproc", "2", *flags, PROBE, str(tmp_path)], env=env, cwd=REPO,
                   timeout_s=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")}


def test_as_deepspeed_and_core_binding(tmp_path: Path) -> None:
    """Every rank imports slipstream as `deepspeed`; each is pinned to its half of the list
    with OMP_NUM_THREADS equal to its share (DeepSpeed's split)."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("needs 2 CPUs")
    cores = f"{allowed[0]},{allowed[1]}"
    ranks = _run(tmp_path, "--as-deepspeed", "--bind_cores_to_rank", "--bind_core_list", cores)
    assert sorted(ranks) == [0, 1]
    assert [ranks[r]["affinity"] for r in (0, 1)] == [[allowed[0]], [allowed[1]]]
    for r in ranks.values():
        assert r["deepspeed"] == "slipstream" and r["omp"] == "1"
        assert r["argv"][0].startswith("--local_rank=")


def test_core_list_syntax_and_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_core_list("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    for bad in ("3-1", "0-2,1", "a", "1-2-3"):
        with pytest.raises(LaunchError, match="--bind_core_list"):
            parse_core_list(bad)
    with pytest.raises(LaunchError, match="2 cores for 3 ranks"):
        plan_core_binding("0-1", 3)
    monkeypatch.setenv("KMP_AFFINITY", "compact")
    with pytest.raises(LaunchError, match="unset KMP_AFFINITY"):
        plan_core_binding("0-1", 2)
