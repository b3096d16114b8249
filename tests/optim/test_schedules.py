"""DeepSpeed lr schedules: lr at chosen steps against the formulas; state dicts; edge cases."""

from __future__ import annotations

import math

import pytest
import torch

from slipstream.config._errors import ConfigError
from slipstream.optim import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR


def _adam(lr: float = 0.1, groups: int = 1) -> torch.optim.Optimizer:
    params = [{"params": [torch.nn.Parameter(torch.zeros(1))]} for _ in range(groups)]
    return torch.optim.Adam(params, lr=lr, betas=(0.9, 0.95))


def _lrs(sched, steps: int) -> dict[int, float]:
    """lr written after each step, keyed by last_batch_iteration (-1: at construction)."""
    seen = {-1: sched.optimizer.param_groups[0]["lr"]}
    for _ in range(steps):
        sched.step()
        seen[sched.last_batch_iteration] = sched.optimizer.param_groups[0]["lr"]
        assert sched.get_last_lr()[0] == seen[sched.last_batch_iteration]
    return seen


def test_warmup_lr_log_and_linear() -> None:
    """log: min + (max - min) * log(it + 1) / log(N); linear: it / N; then held at max."""
    lrs = _lrs(WarmupLR(_adam(), warmup_min_lr=0.0, warmup_max_lr=0.01, warmup_num_steps=100), 150)
    assert lrs[-1] == 0.0 and lrs[0] == 0.0
    assert lrs[1] == pytest.approx(0.01 * math.log(2) / math.log(100))
    assert lrs[49] == pytest.approx(0.01 * math.log(50) / math.log(100))
    assert lrs[100] == lrs[149] == 0.01
    sched = WarmupLR(_adam(), 0.001, 0.011, warmup_num_steps=10, warmup_type="linear")
    lrs = _lrs(sched, 20)
    assert lrs[5] == pytest.approx(0.001 + 0.01 * 0.5)
    assert lrs[10] == lrs[19] == pytest.approx(0.011)


def test_warmup_lr_max_defaults_to_optimizer_lr() -> None:
    """warmup_max_lr=None warms up to the optimizer's lr (DeepSpeed's current behaviour)."""
    sched = WarmupLR(_adam(lr=0.3), warmup_num_steps=4, warmup_type="linear")
    assert _lrs(sched, 6)[5] == pytest.approx(0.3)


def test_warmup_decay_lr() -> None:
    """After warmup, gamma = max(0, (T - it) / max(1, T - N)): linear to 0 at T."""
    sched = WarmupDecayLR(
        _adam(), total_num_steps=20, warmup_max_lr=0.1, warmup_num_steps=10, warmup_type="linear"
    )
    lrs = _lrs(sched, 30)
    assert [lrs[i] for i in (5, 10, 15, 20, 29)] == pytest.approx([0.05, 0.1, 0.05, 0.0, 0.0])


def test_warmup_cosine_lr() -> None:
    """Ratios of the base lr: linear warmup from warmup_min_ratio, cosine down to cos_min_ratio."""
    sched = WarmupCosineLR(
        _adam(lr=0.1),
        total_num_steps=20,
        warmup_min_ratio=0.1,
        warmup_num_steps=10,
        cos_min_ratio=0.01,
        warmup_type="linear",
    )
    lrs = _lrs(sched, 30)
    cos = 0.01 + 0.99 * (1 + math.cos(math.pi * 0.1)) / 2
    expected = {
        -1: 0.0,
        0: 0.01,
        5: 0.055,
        9: 0.091,
        10: 0.1 * cos,
        14: 0.0505,
        19: 0.001,
        29: 0.001,
    }
    assert {i: lrs[i] for i in expected} == pytest.approx(expected)


def test_one_cycle_lr_and_momentum() -> None:
    """Up S1=4 steps, down S2=6, then lr / (1 + rate * k / decay_step_size); beta1 mirrors lr."""
    opt = _adam()
    sched = OneCycle(
        opt,
        cycle_min_lr=0.01,
        cycle_max_lr=0.1,
        decay_lr_rate=0.5,
        cycle_first_step_size=4,
        cycle_second_step_size=6,
        decay_step_size=2,
        cycle_min_mom=0.8,
        cycle_max_mom=0.9,
        decay_mom_rate=0.1,
    )
    assert opt.param_groups[0]["lr"] == 0.01 and opt.param_groups[0]["betas"] == (0.8, 0.95)
    lr, mom = {}, {}
    for _ in range(14):
        sched.step()
        lr[sched.last_batch_iteration] = opt.param_groups[0]["lr"]
        mom[sched.last_batch_iteration] = opt.param_groups[0]["betas"][0]
        assert opt.param_groups[0]["betas"][1] == 0.95  # the group's beta2 is kept
    expected_lr = {0: 0.0325, 3: 0.1, 6: 0.055, 9: 0.01, 10: 0.008, 13: 0.005}
    expected_mom = {0: 0.875, 3: 0.8, 6: 0.85, 9: 0.9, 10: 0.945, 13: 1.08}
    assert {i: lr[i] for i in expected_lr} == pytest.approx(expected_lr)
    assert {i: mom[i] for i in expected_mom} == pytest.approx(expected_mom)


def test_one_cycle_stairs_and_no_betas() -> None:
    """Stair counts floor the cycle scale; SGD (no betas) disables momentum cycling."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0, momentum=0.5)
    sched = OneCycle(opt, 0.0, 1.0, cycle_first_step_size=4, cycle_second_step_size=6,
                     cycle_first_stair_count=2)  # fmt: skip
    assert not sched.cycle_momentum and "betas" not in opt.param_groups[0]
    lrs = _lrs(sched, 9)
    assert [lrs[i] for i in range(9)] == pytest.approx([0, 0.5, 0.5, 1, 0.5, 0.5, 0.5, 0, 0])


def test_lr_range_test_continuous_and_staircase() -> None:
    """lr = min_lr * (1 + rate * (it + 1) / step_size), floored interval with staircase."""
    lrs = _lrs(
        LRRangeTest(_adam(), 0.01, lr_range_test_step_size=10, lr_range_test_step_rate=2), 20
    )
    assert lrs[-1] == 0.01 and lrs[4] == pytest.approx(0.02)
    sched = LRRangeTest(_adam(), 0.01, 10, 2.0, lr_range_test_staircase=True)
    lrs = _lrs(sched, 20)
    assert [lrs[4], lrs[9], lrs[19]] == pytest.approx([0.01, 0.03, 0.05])


SCHEDULES = [
    lambda opt, it=-1: WarmupLR(opt, 0.0, 0.1, 10, last_batch_iteration=it),
    lambda opt, it=-1: WarmupDecayLR(opt, 30, 0.0, 0.1, 10, last_batch_iteration=it),
    lambda opt, it=-1: WarmupCosineLR(opt, 30, warmup_num_steps=10, last_batch_iteration=it),
    lambda opt, it=-1: OneCycle(
        opt, 0.01, 0.1, 0.5, 5, 5, decay_step_size=2, last_batch_iteration=it
    ),
    lambda opt, it=-1: LRRangeTest(opt, 0.01, 5, last_batch_iteration=it),
]


@pytest.mark.parametrize("make", SCHEDULES)
def test_state_dict_round_trip(make) -> None:
    """A fresh scheduler loaded from a state dict continues with the same lrs."""
    opt_a, opt_b = _adam(), _adam()
    a = make(opt_a)
    _lrs(a, 7)
    b = make(opt_b)
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()
    for _ in range(20):
        a.step()
        b.step()
        assert b.get_last_lr() == pytest.approx(a.get_last_lr())
        assert opt_b.param_groups[0]["lr"] == pytest.approx(opt_a.param_groups[0]["lr"])


def test_resume_leaves_lr_and_accepts_deepspeed_state_dict() -> None:
    """last_batch_iteration != -1 does not touch lr; DeepSpeed's {'last_batch_iteration'} loads."""
    opt = _adam(lr=0.123)
    sched = WarmupLR(opt, 0.0, 0.1, 10, warmup_type="linear", last_batch_iteration=4)
    assert opt.param_groups[0]["lr"] == 0.123
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    sched.load_state_dict({"last_batch_iteration": 1})
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.02)


def test_cosine_resume_uses_initial_lr() -> None:
    """WarmupCosineLR built mid-run takes its base lr from the group's saved initial_lr."""
    opt = _adam(lr=0.1)
    _lrs(WarmupCosineLR(opt, 20, warmup_num_steps=10, warmup_type="linear"), 5)
    resumed = WarmupCosineLR(opt, 20, warmup_num_steps=10, warmup_type="linear",
                             last_batch_iteration=4)  # fmt: skip
    assert resumed.base_lrs == [0.1]


def test_tensor_lr_updated_in_place_and_per_group_values() -> None:
    """A tensor lr is filled in place; list params give one value per param group."""
    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=torch.tensor(0.5))
    lr_tensor = opt.param_groups[0]["lr"]
    WarmupLR(opt, 0.2, 0.4, 10).step()
    assert opt.param_groups[0]["lr"] is lr_tensor and lr_tensor.item() == pytest.approx(0.2)
    opt2 = _adam(groups=2)
    sched = WarmupLR(opt2, [0.0, 0.1], [1.0, 2.0], 2, warmup_type="linear")
    _lrs(sched, 3)
    assert sched.get_last_lr() == [1.0, 2.0]
    with pytest.raises(ConfigError, match=r"scheduler\.params\.warmup_max_lr has 3 values"):
        WarmupLR(opt2, 0.0, [1.0, 2.0, 3.0])


def test_warmup_validation_errors() -> None:
    """warmup_type and warmup_num_steps are validated with the key named."""
    with pytest.raises(ConfigError, match=r"warmup_type .*did you mean 'linear'"):
        WarmupLR(_adam(), warmup_type="linaer")
    with pytest.raises(ConfigError, match=r"scheduler\.params\.warmup_num_steps"):
        WarmupCosineLR(_adam(), 100, warmup_num_steps=0)
