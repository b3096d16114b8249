"""Tiny random Hugging Face causal LMs built in code (no download) and left-padded prompts."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

EOS, PAD, VOCAB = 5, 0, 96


def tiny_llama(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        eos_token_id=EOS, pad_token_id=PAD, bos_token_id=1,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).eval()


def tiny_gpt2(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
        eos_token_id=EOS, pad_token_id=PAD, bos_token_id=1,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg).eval()


MODELS = {"llama": tiny_llama, "gpt2": tiny_gpt2}


def left_padded(lengths: list[int], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of the given lengths, left-padded with PAD, tokens never EOS."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.full((len(lengths), max(lengths)), PAD)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, -n:] = torch.randint(EOS + 1, VOCAB, (n,), generator=g)
        mask[i, -n:] = 1
    return ids, mask


@pytest.fixture(params=sorted(MODELS))
def model(request: pytest.FixtureRequest) -> torch.nn.Module:
    return MODELS[request.param]()


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models: one intra-op thread (on a loaded machine two threads spend their time
    waiting for each other at every op)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
