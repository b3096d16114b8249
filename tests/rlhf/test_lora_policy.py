"""LoRAPolicy / apply_lora_policy_ / merge_lora_state_dict (one process, the reference GPT):
DeepSpeed-Chat's flags applied before initialize, merged checkpoints that load as plain models,
and the refusals."""

from __future__ import annotations

import pytest
import torch

from slipstream.config import ConfigError
from slipstream.models import GPT, GPTConfig, LoRALinear
from slipstream.rlhf import LoRAPolicy, apply_lora_policy_, merge_lora_state_dict


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.preset("tiny", vocab_size=32, hidden_size=32, max_seq_len=16))


def test_policy_converts_the_named_layers_and_freezes_the_rest():
    model = _gpt()
    names = apply_lora_policy_(
        model, LoRAPolicy(dim=4, module_name=("q_proj", "v_proj"), only_optimize_lora=True)
    )
    assert names and all(n.endswith(("q_proj", "v_proj")) for n in names)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all(n.endswith(("lora_a", "lora_b")) for n in trained)
    assert apply_lora_policy_(_gpt(), LoRAPolicy(dim=0)) == []  # off


def test_merged_state_dict_loads_into_the_plain_model_with_the_same_outputs():
    """W + (alpha / r) B A replaces the adapters: the plain model given the merged state
    computes what the LoRA model computes (up to fp32 rounding)."""
    model = _gpt()
    apply_lora_policy_(model, LoRAPolicy(dim=4, scaling=8.0))
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_b.copy_(torch.randn(m.lora_b.shape, generator=g) * 0.1)
    plain = _gpt()
    merged = merge_lora_state_dict(model, model.state_dict())
    assert set(merged) == set(plain.state_dict())
    plain.load_state_dict(merged)
    ids = torch.randint(0, 32, (2, 12), generator=g)
    want, got = model(ids), plain(ids)
    assert not torch.allclose(want, _gpt()(ids), atol=1e-3)  # the adapters matter
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_bad_policies_and_late_conversion_are_refused():
    with pytest.raises(ConfigError, match=r"only_optimize_lora=True with dim=0"):
        LoRAPolicy(only_optimize_lora=True)
    with pytest.raises(ConfigError, match=r"dim=-1 must be >= 0"):
        LoRAPolicy(dim=-1)
    with pytest.raises(ConfigError, match=r"force_optimize=\['v_head.weight'\] only matters"):
        LoRAPolicy(dim=4, force_optimize=("v_head.weight",))
    with pytest.raises(ValueError, match=r"no nn.Linear of GPT matches"):
        apply_lora_policy_(_gpt(), LoRAPolicy(dim=4, module_name="decoder.layers."))
    from slipstream.runtime.engine import Engine

    with pytest.raises(RuntimeError, match=r"got an Engine; convert the module before"):
        apply_lora_policy_(Engine.__new__(Engine), LoRAPolicy(dim=4))
