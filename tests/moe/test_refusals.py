"""What MoE does not do yet is refused by name: the AutoEP config block, checkpoints of
expert-parallel models, init_inference's moe keys."""

from __future__ import annotations

from pathlib import Path

import pytest

from slipstream.config._errors import ConfigError
from slipstream.config.loader import read_config
from tests.distributed.harness import run_world
from tests.moe import _ep_workloads as w


def test_autoep_block_is_refused_unless_disabled() -> None:
    base = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0}
    with pytest.raises(ConfigError, match=r"AutoEP \(expert_parallel\) is not implemented yet"):
        read_config({**base, "expert_parallel": {"enabled": True, "autoep_size": 2}})
    read_config({**base, "expert_parallel": {"enabled": False}})


def test_checkpoint_of_expert_parallel_model_is_refused(tmp_path: Path) -> None:
    """Every rank gets the error (no hang), and nothing is written."""
    errors = run_world(w.save_refused, 2, str(tmp_path))
    for e in errors:
        assert "MoE expert parallelism (ep_size > 1) is not supported yet" in e
    assert not any(tmp_path.iterdir())
