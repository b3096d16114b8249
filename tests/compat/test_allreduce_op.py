"""``gradient_allreduce_op``: "sum" adds the data-parallel gradients where "mean" (the default)
averages them, as DeepSpeed's option does; the combinations DeepSpeed refuses are refused.
The same world checks ``safe_set_full_grad``."""

from __future__ import annotations

import pytest
import torch

from slipstream.config import ConfigError, parse_config
from tests.compat import _allreduce_op_workloads as w
from tests.distributed.harness import run_world


def test_sum_is_world_size_times_mean_at_stages_0_and_2() -> None:
    r0, r1 = run_world(w.sgd_step_deltas, 2)
    mean = torch.tensor(r0["0-mean"])
    assert mean.abs().sum() > 0
    for stage in (0, 2):
        summed = torch.tensor(r0[f"{stage}-sum"])
        torch.testing.assert_close(summed, 2 * mean, rtol=1e-6, atol=1e-6)
        assert r0[f"{stage}-sum"] == pytest.approx(r1[f"{stage}-sum"])  # ranks agree
    # safe_set_full_grad (same world): the step applies the gradient set, on both ranks.
    want = [-v / 10 for v in range(6)]
    for r in (r0, r1):
        assert r["set_grad_delta"] == pytest.approx(want, abs=1e-6)
        assert r["set_grad_read"] == pytest.approx([v / 10 for v in range(6)], abs=1e-6)


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        ({"zero_optimization": {"stage": 3}}, "ZeRO stage 3"),
        ({"zero_optimization": {"stage": 2, "zenflow": {}}}, "ZenFlow"),
        ({"compile": {"deepcompile": True}}, "DeepCompile"),
    ],
)
def test_sum_is_refused_where_deepspeed_refuses_it(extra: dict, reason: str) -> None:
    with pytest.raises(ConfigError, match=f"not supported with {reason}"):
        parse_config({"train_batch_size": 1, "gradient_allreduce_op": "sum", **extra})


def test_other_ops_are_refused_and_case_is_ignored() -> None:
    with pytest.raises(ConfigError, match="Invalid gradient_allreduce_op"):
        parse_config({"train_batch_size": 1, "gradient_allreduce_op": "max"})
    cfg = parse_config({"train_batch_size": 1, "gradient_allreduce_op": "SUM"})
    assert cfg.gradient_allreduce_op == "sum"
    assert parse_config({"train_batch_size": 1}).gradient_allreduce_op == "mean"
