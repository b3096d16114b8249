"""GRPO: the answer mask, config validation, and the offline demo raising the held-out
success rate of a rule-based reward with the KL to the reference bounded."""

from __future__ import annotations

import pytest
import torch

from slipstream.config import ConfigError
from slipstream.rlhf import GRPOConfig, completion_mask
from tests.rlhf._hybrid_workloads import result


def test_completion_mask_keeps_tokens_through_the_first_eos():
    """An answer that is only EOS keeps one token (the EOS), so its loss is defined."""
    answers = torch.tensor([[4, 2, 0, 0], [2, 0, 0, 0], [4, 5, 6, 7], [3, 2, 2, 9]])
    got = completion_mask(answers, [2])
    assert got.tolist() == [[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"group_size": 1}, "group_size=1"),
        ({"max_new_tokens": 0}, "max_new_tokens=0"),
        ({"temperature": 0.0}, "temperature=0.0"),
    ],
)
def test_grpo_config_refuses_bad_values(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        GRPOConfig(**kwargs)


@pytest.mark.rlhf_checks("grpo")
def test_demo_raises_held_out_success_with_bounded_kl(rlhf_world):
    """examples/rlhf_grpo.py, 15 steps at 2 ranks (ZeRO-3, 4 prompts x 4 answers per rank):
    the keyword rule's success rate on each rank's held-out prompts rises well above the
    untrained model's, and the per-token KL stays under 1 nat."""
    for r in result(rlhf_world, "grpo"):
        assert r["after"] >= r["before"] + 0.2, r
        assert r["kl"] < 1.0, r
