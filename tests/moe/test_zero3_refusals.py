"""What MoE refuses by name, each beside a neighbour that is accepted: at ZeRO stage 3 with
ep_size 2, expert parameters built under zero.Init and hpZ (zero_hpz_partition_size 2), both
accepted at ep_size 1; gradient_allreduce_op 'sum' with MoE layers ('mean' accepted); an
ep_size that does not divide the data-parallel size; ep_size 2 without a process group;
topkgating's 'position' drop policy; and use_tutel, accepted with a log line. One forked
2-rank world runs the multi-rank cases."""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.distributed.harness import run_fresh, run_world
from tests.moe import _ep_workloads as ew


def _initialize(net: torch.nn.Module, stage: int, **extra: Any) -> str:
    """``slipstream.initialize`` and one step; ``"ok"`` or the error's type and message."""
    import slipstream

    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "SGD", "params": {"lr": ew.LR}},
        "zero_optimization": {"stage": stage, **extra.pop("zero", {})},
        **extra,
    }
    try:
        engine, _, _, _ = slipstream.initialize(
            model=net, model_parameters=net.parameters(), config=config
        )
    except Exception as e:  # the message is what the test pins
        return f"{type(e).__name__}: {e}"
    x, y = ew.batches(dist.get_rank())[0]
    engine.backward(engine(x, y))
    engine.step()
    engine.destroy()
    return "ok"


def _net(ep: int) -> torch.nn.Module:
    return ew.local_copy(ew.reference(2), ep, dist.get_rank() % ep, 2)


def _init_net(ep: int) -> torch.nn.Module:
    import slipstream

    torch.manual_seed(0)
    with slipstream.zero.Init():
        return ew.Net(ep, 2)


def world() -> dict[str, str]:
    """Each case on both ranks (every rank raises at the same point, so no rank waits)."""
    hpz = {"zero": {"zero_hpz_partition_size": 2}}
    return {
        "init_ep2": _initialize(_init_net(2), 3),
        "init_ep1": _initialize(_init_net(1), 3),
        "hpz_ep2": _initialize(_net(2), 3, **hpz),
        "hpz_ep1": _initialize(_net(1), 3, **hpz),
        "sum_ep2": _initialize(_net(2), 1, gradient_allreduce_op="sum"),
        "mean_ep2": _initialize(_net(2), 1, gradient_allreduce_op="mean"),
        "ep4_on_2": _initialize(ew.Net(4, 2), 1),
    }


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, str]]:
    return run_world(world, 2, timeout_s=300)


@pytest.mark.parametrize(
    ("case", "want"),
    [
        (
            "init_ep2",
            r"ValueError: MoE expert parameters of ep_size 2 built under zero.Init .* build the "
            r"MoE model outside deepspeed.zero.Init",
        ),
        (
            "hpz_ep2",
            r"ValueError: zero_optimization.zero_hpz_partition_size = 2 with MoE expert "
            r"parallelism \(ep_size 2\) is not supported: set zero_hpz_partition_size to 1",
        ),
        (
            "sum_ep2",
            r"ConfigError: config key 'gradient_allreduce_op' = 'sum' is not supported with MoE "
            r"expert layers .*: use 'mean'",
        ),
        (
            "ep4_on_2",
            r"ValueError: ep_size=4 must divide the data-parallel size 2",
        ),
    ],
)
def test_refused_by_name(ranks: list[dict[str, str]], case: str, want: str) -> None:
    """The refusal names the key, the value and the fix, on every rank."""
    for res in ranks:
        assert res[case] != "ok"
        assert re.search(want, res[case]), res[case]


@pytest.mark.parametrize("case", ["init_ep1", "hpz_ep1", "mean_ep2"])
def test_the_neighbour_is_accepted(ranks: list[dict[str, str]], case: str) -> None:
    """The refusals are narrow: zero.Init and hpZ at ep_size 1 (experts replicated, cut like
    dense parameters), and 'mean' at ep_size 2, initialize and take a step."""
    for res in ranks:
        assert res[case] == "ok"


def _ep2_without_a_group() -> str:
    from slipstream.moe import expert_parallel_

    try:
        expert_parallel_(ew.Net(2, 1), None)
    except ValueError as e:
        return str(e)
    return "ok"


def test_ep_size_without_processes() -> None:
    """A fresh process with no process group: ep_size 2 asks for 2 processes."""
    done = run_fresh(_ep2_without_a_group)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.result.startswith("ep_size=2 needs 2 processes: launch with"), done.result  # type: ignore[attr-defined]


def test_topkgating_position_policy_is_refused() -> None:
    from slipstream.moe.sharded_moe import topkgating

    with pytest.raises(ValueError, match="drop_policy='position' is not supported: only 'probs'"):
        topkgating(torch.randn(8, 4), 2, 1.0, 1, drop_policy="position")
    l_aux, *_ = topkgating(torch.randn(8, 4), 2, 1.0, 1, drop_policy="probs")
    assert torch.isfinite(l_aux)


def test_use_tutel_is_accepted_with_a_log_line(caplog: pytest.LogCaptureFixture) -> None:
    """use_tutel=True builds the same layer (same output) and says it is ignored."""
    from slipstream.moe import MoE

    def build(tutel: bool) -> MoE:
        torch.manual_seed(0)
        return MoE(4, torch.nn.Linear(4, 4), num_experts=2, use_tutel=tutel, use_rts=False)

    with caplog.at_level(logging.INFO, logger="slipstream"):
        tutel = build(True)
    assert "use_tutel=True ignored" in caplog.text
    x = torch.randn(6, 4)
    torch.testing.assert_close(tutel(x)[0], build(False)(x)[0], rtol=0, atol=0)
