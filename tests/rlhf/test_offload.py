"""Host-resident frozen models (offload_frozen_, DeepSpeed-Chat's --offload_reference_model):
same outputs, parameters on the host between forwards, one unit's copies on the device at a
time, and clear refusals. One process; on this CPU-only machine the "device" copies are
explicit CPU copies (the path a GPU takes, minus the host link)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from slipstream.rlhf import offload_frozen_


def _llama(tie: bool = False) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        tie_word_embeddings=tie,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).requires_grad_(False).eval()


def _ids() -> torch.Tensor:
    return torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("tie", [False, True])
def test_offloaded_model_gives_the_same_logits_and_streams_one_block_at_a_time(tie):
    """Logits equal the resident model's; between forwards every parameter is its host
    copy; each forward fetches every unit once (3 blocks + embedding + norm + head; a tied
    head shares the embedding's copy) and the device never holds more than the root-level
    parameters plus one block."""
    model = _llama(tie)
    resident = copy.deepcopy(model)
    state = offload_frozen_(model, device="cpu")
    with torch.no_grad():
        got, want = model(input_ids=_ids()).logits, resident(input_ids=_ids()).logits
    assert torch.equal(got, want)
    assert all(p.data_ptr() == state.host[id(p)].data_ptr() for p in model.parameters())
    assert state.fetched_bytes == 0
    assert state.fetches == 6  # 3 decoder blocks, embed_tokens, norm, lm_head
    nbytes = lambda ps: sum(p.numel() * p.element_size() for p in ps)  # noqa: E731
    root = nbytes({id(p): p for m in (model.model.embed_tokens, model.model.norm, model.lm_head)
                   for p in m.parameters()}.values())  # fmt: skip
    block = nbytes(model.model.layers[0].parameters())
    total = nbytes(model.parameters())
    assert state.peak_fetched_bytes <= root + block < total


def test_a_submodule_called_alone_fetches_its_own_parameters():
    """Units are the blocks and the modules holding parameters directly, so calling one
    block (or the embedding) alone works and releases after."""
    model = _llama()
    state = offload_frozen_(model, device="cpu")
    emb = model.model.embed_tokens(_ids())
    assert emb.shape == (2, 9, 32) and state.fetched_bytes == 0 and state.fetches == 1


def test_remove_leaves_a_plain_host_model():
    model = _llama()
    state = offload_frozen_(model, device="cpu")
    state.remove()
    model(input_ids=_ids())
    assert state.fetches == 0


def test_trainable_models_and_engines_are_refused():
    model = _llama()
    model.lm_head.weight.requires_grad_(True)
    with pytest.raises(ValueError, match=r"trainable parameters \['lm_head.weight'\]"):
        offload_frozen_(model, device="cpu")

    from slipstream.runtime.engine import Engine

    fake_engine = Engine.__new__(Engine)
    with pytest.raises(TypeError, match=r"got an Engine; pass the frozen nn\.Module"):
        offload_frozen_(fake_engine, device="cpu")
