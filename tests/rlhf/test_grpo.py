"""GRPO: the answer mask, config validation, and the offline demo raising the held-out
success rate of a rule-based reward with the KL to the reference bounded."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slipstream.config import ConfigError
from slipstream.rlhf import GRPOConfig, completion_mask

ROOT = Path(__file__).resolve().parents[2]


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


def test_demo_raises_held_out_success_with_bounded_kl():
    """examples/rlhf_grpo.py, shortened: the keyword rule's success rate on held-out prompts
    rises well above the untrained model's, and the per-token KL stays under 1 nat."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "rlhf_grpo.py"), "--steps", "15"],
        capture_output=True, text=True, timeout=180, cwd=ROOT,
    )  # fmt: skip
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-3000:]
    m = re.search(r"before (\d\.\d+) after (\d\.\d+); KL to reference (\d\.\d+)", text)
    assert m is not None, text[-2000:]
    before, after, kl = (float(x) for x in m.groups())
    assert after >= before + 0.2, (before, after)
    assert kl < 1.0
