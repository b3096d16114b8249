"""zero.Init: construction allocates no parameters; materialization gives eager's values."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import slipstream
from slipstream.models import GPT, GPTConfig
from slipstream.zero import Init, materialize_
from tests.distributed.harness import run_world


@pytest.mark.parametrize("tie", [False, True])
def test_gpt_under_init_materializes_to_eager_weights_bit_for_bit(tie):
    cfg = GPTConfig.preset("tiny", tie_embeddings=tie)
    torch.manual_seed(3)
    eager = GPT(cfg)
    torch.manual_seed(3)
    with Init():
        model = GPT(cfg)
    assert all(p.is_meta for p in model.parameters())
    assert not model.rope_cos.is_meta  # buffers stay real
    assert (model.lm_head.weight is model.embed_tokens.weight) == tie
    peak = materialize_(model, "cpu")
    largest = max(p.numel() for p in model.parameters())
    assert largest <= peak < sum(p.numel() for p in model.parameters())
    assert (model.lm_head.weight is model.embed_tokens.weight) == tie
    for (name, a), (_, b) in zip(eager.state_dict().items(), model.state_dict().items()):
        assert torch.equal(a, b), name
    x = torch.randint(0, 256, (2, 8))
    assert torch.equal(eager(x, x), model(x, x))


def test_hf_model_under_init_gets_the_same_initializers():
    """HF models: _init_weights per module, so same distributions (not the same draws)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    eager = transformers.LlamaForCausalLM(cfg)
    with Init():
        model = transformers.LlamaForCausalLM(cfg)
    assert all(p.is_meta for p in model.parameters())
    materialize_(model, "cpu")
    for (name, a), (_, b) in zip(eager.named_parameters(), model.named_parameters()):
        if "norm" in name:
            assert torch.equal(a, b), name  # ones
        else:
            assert not torch.equal(a, b), name
            torch.testing.assert_close(b.std(), a.std(), rtol=0.15, atol=0, msg=name)


def test_plain_torch_modules_fall_back_to_reset_parameters_and_dtype_applies():
    torch.manual_seed(1)
    with Init(dtype=torch.bfloat16):
        model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8))
    assert model[0].weight.dtype == torch.bfloat16 and model[0].weight.is_meta
    materialize_(model, "cpu")
    assert model[0].weight.abs().max() <= 0.5 + 1e-3  # kaiming uniform bound 1/sqrt(4)
    assert model[0].weight.std() > 0.05
    assert torch.equal(model[1].weight, torch.ones(8, dtype=torch.bfloat16))


def test_module_without_any_initializer_is_named_in_the_error():
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.ones(3))

    with Init():
        model = nn.Sequential(nn.Linear(3, 3), Scale())
    with pytest.raises(TypeError, match=r"module '1' \(Scale\).*\['gain'\].*reset_parameters"):
        materialize_(model, "cpu")


def test_init_rejects_options_it_does_not_implement():
    with pytest.raises(NotImplementedError, match="remote_device"):
        Init(remote_device="cpu")
    with pytest.raises(ValueError, match="stage = 2"):
        Init(config_dict_or_path={"zero_optimization": {"stage": 2}})
    with Init(enabled=False):
        assert not nn.Linear(2, 2).weight.is_meta


def _train_first_losses(stage: int, deferred: bool) -> list[float]:
    torch.manual_seed(0)
    if deferred:
        with Init():
            model = GPT(GPTConfig.preset("tiny"))
    else:
        model = GPT(GPTConfig.preset("tiny"))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage},
    }
    engine, _, _, _ = slipstream.initialize(model=model, config=config)
    losses = []
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randint(0, 256, (2, 16), generator=g)
        loss = engine(x, x)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.destroy()
    return losses


def _all_stages() -> dict[tuple[int, bool], list[float]]:
    return {(s, d): _train_first_losses(s, d) for s in (0, 3) for d in (False, True)}


def test_engine_trains_an_init_model_like_an_eager_one_at_every_stage():
    """One process: stage 0 materializes in full, stage 3 into shards; same losses."""
    (got,) = run_world(_all_stages, 1)
    for stage in (0, 3):
        assert got[(stage, True)] == got[(stage, False)], stage
