"""Parameter counts of the spec's model configurations against the closed form and the paper."""

from __future__ import annotations

import pytest

from slipstream.models.gpt import GPT, GPTConfig
from slipstream.planner import ModelSpec, from_gpt_config, from_hf_config, model_preset


def _closed_form(n: int, h: int, v: int = 51200, s: int = 2048) -> float:
    """P = 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h)) (Narayanan et al. 2021), l = n."""
    return 12 * n * h * h * (1 + 13 / (12 * h) + (v + s) / (12 * n * h))


@pytest.mark.parametrize(
    ("preset", "published"),
    [("frontier-22b", 22.1e9), ("frontier-175b", 174.6e9), ("frontier-1t", 1.008e12)],
)
def test_spec_parameter_counts(preset: str, published: float) -> None:
    """Counts match specs/parallelism.md sec. 4.3 (to its 4 digits) and the closed form."""
    model = model_preset(preset)
    n = model.num_params()
    assert n == pytest.approx(published, rel=5e-3)
    # The closed form leaves out only the final LayerNorm (2h).
    assert n - _closed_form(model.layers, model.hidden) == pytest.approx(2 * model.hidden, abs=1)


def test_per_layer_count_is_12h2_plus_13h() -> None:
    model = model_preset("gpt3-175b")
    h = model.hidden
    assert model.params_per_layer() == 12 * h * h + 13 * h
    assert model.matmul_params_per_layer() == 12 * h * h


def test_reference_gpt_count_matches_the_module() -> None:
    """The LLaMA-style spec counts exactly the parameters slipstream's GPT allocates."""
    config = GPTConfig.preset("tiny")
    built = sum(p.numel() for p in GPT(config).parameters())
    assert from_gpt_config(config).num_params() == built


def test_hf_llama_config() -> None:
    spec = from_hf_config(
        {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 192, "vocab_size": 100,
         "max_position_embeddings": 32, "tie_word_embeddings": False}
    )  # fmt: skip
    # q,o: 64*64 each; k,v: 64*32 each; mlp 3*64*192; norms 2*64; embed+head 2*100*64; norm 64.
    per_layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 192 + 2 * 64
    assert spec.num_params() == 2 * per_layer + 2 * 100 * 64 + 64


def test_bad_shapes_are_named() -> None:
    with pytest.raises(ValueError, match="hidden = 100 is not divisible by heads = 3"):
        ModelSpec(layers=2, hidden=100, heads=3, vocab=10, seq=8)
    with pytest.raises(ValueError, match="unknown model preset 'gpt-9'"):
        model_preset("gpt-9")
