"""What MoE does not do yet is refused by name: checkpoints of expert-parallel models."""

from __future__ import annotations

from pathlib import Path

from tests.distributed.harness import run_world
from tests.moe import _ep_workloads as w


def test_checkpoint_of_expert_parallel_model_is_refused(tmp_path: Path) -> None:
    """Every rank gets the error (no hang), and nothing is written."""
    errors = run_world(w.save_refused, 2, str(tmp_path))
    for e in errors:
        assert "MoE expert parallelism (ep_size > 1) is not supported yet" in e
    assert not any(tmp_path.iterdir())
