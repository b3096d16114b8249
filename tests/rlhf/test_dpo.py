"""DPO trainer (2 ranks, ZeRO-2, tiny LLaMA on a sorting preference task): the reported loss
of a batch equals the loss written out token by token, and a few steps raise the held-out
chosen-vs-rejected margin."""

from __future__ import annotations

import math

import pytest

from slipstream.config import ConfigError
from slipstream.rlhf import DPOConfig
from tests.rlhf._hybrid_workloads import result


@pytest.mark.rlhf_checks("dpo")
def test_reported_loss_equals_the_hand_computed_one(rlhf_world):
    """Step 4's loss (taken before its update) equals -log sigmoid(beta (margin_c -
    margin_r)) summed over answer tokens by hand from the same weights; step 1, with the
    policy equal to the reference, is exactly log 2."""
    for r in result(rlhf_world, "dpo"):
        assert r["metrics"][0].loss == pytest.approx(math.log(2.0), abs=1e-6)
        assert r["metrics"][3].loss == pytest.approx(r["manual_loss"], abs=1e-5)


@pytest.mark.rlhf_checks("dpo")
def test_a_few_steps_raise_the_chosen_vs_rejected_margin(rlhf_world):
    for r in result(rlhf_world, "dpo"):
        assert r["margin_before"] == 0.0
        assert r["margin_after"] > 1.0, r["margin_after"]
        margins = [m.margin for m in r["metrics"]]
        assert margins[-1] > margins[1] > 0.0, margins
        assert r["metrics"][-1].accuracy >= 0.75


def test_beta_must_be_positive():
    with pytest.raises(ConfigError, match="beta=0"):
        DPOConfig(beta=0)
