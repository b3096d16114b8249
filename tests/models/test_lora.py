"""LoRA: unchanged at conversion, adapters-only gradients and training, fuse/unfuse, state dicts."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from slipstream.models import GPT, GPTConfig, LoRALinear
from slipstream.models.lora import (
    apply_lora_,
    convert_linear_layer_to_lora,
    fuse_lora_,
    fused_lora,
    load_lora_state_dict,
    lora_state_dict,
    only_optimize_lora_parameters,
    unfuse_lora_,
)

TARGETS = ["q_proj", "v_proj", "down_proj"]


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.preset("tiny", vocab_size=64, hidden_size=32, max_seq_len=32))


def _ids() -> torch.Tensor:
    return torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))


def _randomize_b(model: nn.Module) -> None:
    """Give the zero-initialised B matrices values, so the adapters change the output."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_b.copy_(torch.randn(m.lora_b.shape, generator=g) * 0.1)


def test_conversion_keeps_names_and_output_and_matches_only_the_targets() -> None:
    ids = _ids()
    ref_model = _gpt()
    ref, ref_state = ref_model(ids), ref_model.state_dict()
    model = _gpt()
    names = apply_lora_(model, TARGETS, rank=4, alpha=8)
    assert len(names) == 3 * model.config.num_layers
    assert all(any(t in n for t in TARGETS) for n in names)
    assert isinstance(model.layers[0].attn.q_proj, LoRALinear)
    assert type(model.layers[0].attn.k_proj) is nn.Linear
    assert torch.equal(model(ids), ref)  # B = 0: the model is unchanged
    # the base checkpoint loads by the same names; only the adapters are new keys
    missing, unexpected = model.load_state_dict(ref_state, strict=False)
    assert unexpected == [] and all(k.endswith(("lora_a", "lora_b")) for k in missing)
    assert model.layers[0].attn.q_proj.scaling == 2.0


def test_only_lora_parameters_get_gradients_and_training_moves_only_them() -> None:
    model = _gpt()
    apply_lora_(model, TARGETS, rank=4)
    only_optimize_lora_parameters(model, force_optimize_params=["norm.weight"])
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in model.named_parameters()
                         if n.endswith(("lora_a", "lora_b"))} | {"norm.weight"}  # fmt: skip
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = _ids()
    losses = []
    for _ in range(5):
        loss = model(ids[:, :-1], ids[:, 1:])
        opt.zero_grad()
        loss.backward()
        assert all(p.grad is None for n, p in model.named_parameters() if n not in trainable)
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) == (n not in trainable), n


def test_fuse_and_unfuse_round_trip() -> None:
    model = _gpt()
    apply_lora_(model, TARGETS, rank=4, alpha=16)
    _randomize_b(model)
    ids = _ids()
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        adapted = model(ids)
        with fused_lora(model):
            fused = model(ids)
            layer = model.layers[0].attn.q_proj
            assert layer.fused and not torch.equal(
                layer.weight, base["layers.0.attn.q_proj.weight"]
            )
            state = model.state_dict()  # checkpoints hold the unfused weight
    torch.testing.assert_close(fused, adapted, rtol=1e-5, atol=1e-5)
    assert not torch.equal(adapted, _gpt()(ids))
    for n, p in model.named_parameters():
        torch.testing.assert_close(p, base[n], rtol=0, atol=1e-6)  # fp32 rounding
        torch.testing.assert_close(state[n], base[n], rtol=0, atol=1e-6)
    # keep_base restores the weight bit for bit
    fuse_lora_(model, keep_base=True)
    unfuse_lora_(model)
    assert model.layers[0].attn.q_proj.fused is False
    fuse_lora_(model, keep_base=True)
    unfuse_lora_(model)
    kept = {n: p.detach().clone() for n, p in model.named_parameters()}
    fuse_lora_(model, keep_base=True)
    unfuse_lora_(model)
    assert all(torch.equal(p, kept[n]) for n, p in model.named_parameters())


def test_fused_layers_refuse_training_and_changed_adapters() -> None:
    model = _gpt()
    apply_lora_(model, "q_proj", rank=2)
    fuse_lora_(model)
    with pytest.raises(RuntimeError, match=r"fused into the base weight.*unfuse_lora_"):
        model(_ids())
    with torch.no_grad():
        model.layers[0].attn.q_proj.lora_b.add_(1.0)
    with pytest.raises(RuntimeError, match="modified while fused"):
        unfuse_lora_(model)


def test_lora_state_dict_round_trip_and_errors() -> None:
    model = _gpt()
    apply_lora_(model, TARGETS, rank=4)
    _randomize_b(model)
    saved = lora_state_dict(model)
    assert set(saved) == {n for n, _ in model.named_parameters() if "lora_" in n}
    other = _gpt()
    apply_lora_(other, TARGETS, rank=4)
    load_lora_state_dict(other, saved)
    ids = _ids()
    assert torch.equal(other(ids), model(ids))
    wrong_rank = _gpt()
    apply_lora_(wrong_rank, TARGETS, rank=2)
    with pytest.raises(ValueError, match=r"lora_a has shape \(4, 32\).*\(2, 32\)"):
        load_lora_state_dict(wrong_rank, saved)
    fewer = _gpt()
    apply_lora_(fewer, "q_proj", rank=4)
    with pytest.raises(ValueError, match="adapter names differ"):
        load_lora_state_dict(fewer, saved)


def test_deepspeed_chat_names_and_bad_input() -> None:
    model = convert_linear_layer_to_lora(_gpt(), "layers.1.", lora_dim=4, lora_scaling=2.0)
    lora = [n for n, m in model.named_modules() if isinstance(m, LoRALinear)]
    assert len(lora) == 7 and all(n.startswith("layers.1.") for n in lora)
    assert model.layers[1].mlp.up_proj.scaling == 0.5  # lora_scaling / lora_dim
    with pytest.raises(ValueError, match=r"no nn.Linear of GPT matches 'nope'.*q_proj"):
        apply_lora_(_gpt(), "nope", rank=4)
    with pytest.raises(ValueError, match="rank=0 must be >= 1"):
        apply_lora_(_gpt(), "q_proj", rank=0)
    with pytest.raises(ValueError, match=r"\['typo'\] are not parameters"):
        only_optimize_lora_parameters(model, ["typo"])
    with pytest.raises(ValueError, match="has no LoRA layer"):
        only_optimize_lora_parameters(_gpt())
