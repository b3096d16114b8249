"""Tests for the reference GPT model (slipstream/models/gpt.py)."""

from __future__ import annotations

import math

import pytest
import torch

from slipstream.models import GPT, GPTConfig


def _tiny(**overrides: object) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.preset("tiny", **overrides))


def _ids(b: int = 2, t: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (b, t), generator=torch.Generator().manual_seed(seed))


def test_logits_shape_and_loss_is_scalar() -> None:
    """forward returns [B, T, V] logits without labels and a scalar fp32 loss with them."""
    model = _tiny()
    x = _ids()
    assert model(x).shape == (2, 16, 256)
    loss = model(x, x)
    assert loss.shape == () and loss.dtype == torch.float32


def test_untrained_loss_is_near_uniform() -> None:
    """A freshly initialised model predicts ~uniformly: loss ~ ln(256)."""
    loss = _tiny()(_ids(), _ids(seed=2)).item()
    assert abs(loss - math.log(256)) < 0.3


def test_ignore_index_positions_do_not_count() -> None:
    """Labels of -100 are ignored: masking half the positions equals the loss on the rest."""
    model = _tiny()
    x, y = _ids(), _ids(seed=2)
    masked = y.clone()
    masked[:, :8] = -100
    logits = model(x)
    expected = torch.nn.functional.cross_entropy(
        logits[:, 8:].reshape(-1, 256), y[:, 8:].reshape(-1)
    )
    torch.testing.assert_close(model(x, masked), expected)


def test_overfits_a_repeated_batch() -> None:
    """A few Adam steps on one batch drive the loss far below ln(256)."""
    model = _tiny()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = _ids(), _ids(seed=2)
    first = model(x, y).item()
    for _ in range(40):
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        opt.step()
    assert loss.item() < 0.3 * first


def test_mha_and_gqa_give_same_shapes_and_kv_sizes() -> None:
    """num_kv_heads == num_heads is plain MHA; GQA shrinks only k/v projections."""
    mha, gqa = _tiny(num_kv_heads=4), _tiny(num_kv_heads=2)
    x = _ids()
    assert mha(x).shape == gqa(x).shape
    assert mha.layers[0].attn.k_proj.weight.shape == (64, 64)
    assert gqa.layers[0].attn.k_proj.weight.shape == (32, 64)
    assert GPTConfig(hidden_size=64, num_heads=4).num_kv_heads == 4


def test_tied_embeddings_share_storage_and_reduce_params() -> None:
    """tie_embeddings makes lm_head and embed_tokens one tensor, counted once."""
    untied, tied = _tiny(), _tiny(tie_embeddings=True)
    assert tied.lm_head.weight is tied.embed_tokens.weight
    assert tied.lm_head.weight.data_ptr() == tied.embed_tokens.weight.data_ptr()
    assert untied.num_params() - tied.num_params() == 256 * 64
    assert "lm_head.weight" not in dict(tied.named_parameters())


def test_bf16_forward_runs() -> None:
    """A model cast to bf16 produces finite bf16 logits and an fp32 loss."""
    model = _tiny().to(torch.bfloat16)
    x = _ids()
    logits = model(x)
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    assert model.rope_cos.dtype == torch.bfloat16
    loss = model(x, x)
    assert loss.dtype == torch.float32 and abs(loss.item() - math.log(256)) < 0.5


def test_causality() -> None:
    """Changing token t changes no logits at positions before t."""
    model = _tiny()
    x = _ids()
    x2 = x.clone()
    x2[:, 10] = (x2[:, 10] + 1) % 256
    a, b = model(x), model(x2)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_state_dict_holds_parameters_only_with_hf_like_names() -> None:
    """RoPE caches are non-persistent buffers; parameter names are the stable TP-plan names."""
    keys = set(_tiny().state_dict())
    assert not any("rope" in k for k in keys)
    for name in (
        "embed_tokens.weight",
        "layers.1.attn.q_proj.weight",
        "layers.1.attn.k_proj.weight",
        "layers.1.attn.v_proj.weight",
        "layers.1.attn.o_proj.weight",
        "layers.1.mlp.gate_proj.weight",
        "layers.1.mlp.up_proj.weight",
        "layers.1.mlp.down_proj.weight",
        "layers.1.attn_norm.weight",
        "layers.1.mlp_norm.weight",
        "norm.weight",
        "lm_head.weight",
    ):
        assert name in keys


def test_init_is_deterministic_and_meta_path_matches() -> None:
    """Same seed gives same weights, and meta + to_empty + init_weights() gives the same too."""
    config = GPTConfig.preset("tiny", tie_embeddings=True)
    torch.manual_seed(3)
    direct = GPT(config)
    with torch.device("meta"):
        lazy = GPT(config)
    lazy.to_empty(device="cpu")
    torch.manual_seed(3)
    lazy.init_weights()
    assert lazy.lm_head.weight is lazy.embed_tokens.weight
    for (name, p), q in zip(direct.state_dict().items(), lazy.state_dict().values()):
        assert torch.equal(p, q), name
    torch.testing.assert_close(direct.rope_cos, lazy.rope_cos)
    resid_std = direct.layers[0].attn.o_proj.weight.std().item()
    assert resid_std < 0.02 / math.sqrt(2 * 2) * 1.2


def test_generate_greedy_is_deterministic_and_crops_context() -> None:
    """Greedy generate appends max_new_tokens, repeats exactly, and runs past max_seq_len."""
    model = _tiny().eval()
    prompt = _ids(b=2, t=60)
    out = model.generate(prompt, max_new_tokens=10, temperature=0.0)
    assert out.shape == (2, 70) and torch.equal(out[:, :60], prompt)
    assert torch.equal(out, model.generate(prompt, max_new_tokens=10, temperature=0.0))


def test_generate_sampling_is_reproducible_with_generator() -> None:
    """Sampling with top_k and a seeded generator is reproducible."""
    model = _tiny().eval()
    prompt = _ids(b=1, t=4)
    a = model.generate(prompt, 8, top_k=5, generator=torch.Generator().manual_seed(0))
    b = model.generate(prompt, 8, top_k=5, generator=torch.Generator().manual_seed(0))
    assert a.shape == (1, 12) and torch.equal(a, b)


def test_too_long_input_raises() -> None:
    """Inputs longer than max_seq_len raise with the limit in the message."""
    with pytest.raises(ValueError, match="max_seq_len=64"):
        _tiny()(_ids(t=65))


@pytest.mark.parametrize(
    ("name", "low", "high"), [("tiny", 0.1e6, 0.3e6), ("small", 3e6, 5e6), ("25m", 20e6, 30e6)]
)
def test_preset_param_counts(name: str, low: float, high: float) -> None:
    """Presets stay within their stated sizes (built on meta, no memory)."""
    with torch.device("meta"):
        model = GPT(GPTConfig.preset(name))
    assert low <= model.num_params() <= high
    assert model.num_params(exclude_embeddings=True) < model.num_params()
    assert model.flops_per_token() > 6 * model.num_params(exclude_embeddings=True)


def test_flops_per_token_formula() -> None:
    """flops_per_token = 6 * matmul params + 12 * L * H * D * T (PaLM appendix B)."""
    model = _tiny()
    n_matmul = model.num_params() - 256 * 64 - 64 * (2 * 2 + 1)  # minus embedding and norms
    assert model.flops_per_token(seq_len=32) == 6 * n_matmul + 12 * 2 * 4 * 16 * 32


def test_preset_overrides_and_unknown_name() -> None:
    """preset() applies overrides and lists valid names for an unknown one."""
    config = GPTConfig.preset("small", max_seq_len=128, hidden_size=128)
    assert config.max_seq_len == 128 and config.intermediate_size == 384
    with pytest.raises(ValueError, match=r"unknown GPTConfig preset 'huge'.*tiny, small, 25m"):
        GPTConfig.preset("huge")
    with pytest.raises(ValueError, match=r"unknown GPTConfig field\(s\) \['hiden_size'\]"):
        GPTConfig.preset("tiny", hiden_size=32)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            dict(hidden_size=64, num_heads=3),
            "GPTConfig.hidden_size=64 is not divisible by num_heads=3",
        ),
        (
            dict(hidden_size=64, num_heads=4, num_kv_heads=3),
            "GPTConfig.num_kv_heads=3 does not divide num_heads=4; set num_kv_heads to a divisor",
        ),
        (dict(num_layers=0), "GPTConfig.num_layers=0 must be a positive integer"),
        (dict(hidden_size=36, num_heads=4), "head_dim=hidden_size/num_heads=9 is odd"),
        (dict(dropout=1.0), r"GPTConfig.dropout=1.0 must be in \[0, 1\)"),
        (dict(rope_theta=0.0), "GPTConfig.rope_theta=0.0 must be > 0"),
        (dict(norm_eps=0.0), "GPTConfig.norm_eps=0.0 must be > 0"),
    ],
)
def test_config_validation_errors(kwargs: dict[str, object], message: str) -> None:
    """Invalid configs raise ValueError naming the field, value and fix."""
    with pytest.raises(ValueError, match=message):
        GPTConfig(**kwargs)  # type: ignore[arg-type]


def test_default_intermediate_size_is_rounded_8_thirds() -> None:
    """intermediate_size None -> 8/3 * hidden rounded up to a multiple of 64."""
    assert GPTConfig(hidden_size=64, num_heads=4).intermediate_size == 192
    assert GPTConfig(hidden_size=512, num_heads=8).intermediate_size == 1408


def test_hf_llama_builds_offline_and_matches_gpt_logits() -> None:
    """An HF LlamaForCausalLM builds from a config offline, gives a loss, and matches GPT."""
    transformers = pytest.importorskip("transformers")
    hf_config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_config)
    x = _ids()
    loss = hf(input_ids=x, labels=x).loss
    assert abs(loss.item() - math.log(256)) < 0.3

    model = _tiny(intermediate_size=128)
    renames = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
    state = {}
    for key, value in model.state_dict().items():
        hf_key = key.replace(".attn.", ".self_attn.")
        for ours, theirs in renames.items():
            hf_key = hf_key.replace(ours, theirs)
        state[hf_key if key.startswith("lm_head") else f"model.{hf_key}"] = value
    hf.load_state_dict(state, strict=True)
    torch.testing.assert_close(hf(input_ids=x).logits, model(x), atol=1e-5, rtol=1e-5)
