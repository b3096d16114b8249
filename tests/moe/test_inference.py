"""init_inference with MoE models: DeepSpeed's moe keys are accepted or refused by name
(ep_size 2: tests/moe/test_moe_inference_ep.py), and a GPT with experts generates with the
KV cache as without it."""

from __future__ import annotations

import pytest
import torch

import slipstream
from slipstream.config._errors import ConfigError
from slipstream.models import GPT, GPTConfig, GPTMoEConfig


@pytest.mark.parametrize("capacity_factor", [None, 64.0])
def test_moe_gpt_generates_with_the_kv_cache(capacity_factor: float | None) -> None:
    """Greedy generation through init_inference (KV cache) equals the model's own
    recomputing generate (dropless, or top-1 with a capacity no token exceeds)."""
    torch.manual_seed(0)
    moe = GPTMoEConfig(num_experts=4, every=1, k=1, capacity_factor=capacity_factor, min_capacity=0)
    model = GPT(GPTConfig.preset("tiny", moe=moe)).eval()
    engine = slipstream.init_inference(
        model,
        config={"moe": {"enabled": True, "ep_size": 1, "moe_experts": [4], "type": "standard"}},
    )
    ids = torch.randint(0, 256, (2, 5))
    out = engine.generate(ids, max_new_tokens=6, do_sample=False)
    torch.manual_seed(1)
    assert out.tolist() == model.generate(ids, 6, temperature=0).tolist()


def test_moe_keys() -> None:
    model = torch.nn.Linear(4, 4)
    slipstream.init_inference(
        model, config={"moe_experts": [1], "moe_type": "standard", "ep_size": 1}
    )
    with pytest.raises(ConfigError, match="'moe_type' = 'sparse'"):
        slipstream.init_inference(model, config={"moe_type": "sparse"})
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['ep_group'\]"):
        slipstream.init_inference(model, config={"moe": {"ep_group": None}})
