"""Tiny models built in code (no download) and left-padded prompts, shared by the tests.

Every builder seeds torch first, so a seed gives the same weights in every test and rank.
"""

from __future__ import annotations

import torch

EOS, PAD, VOCAB = 5, 0, 96


def tiny_llama(
    seed: int = 0,
    *,
    layers: int = 2,
    vocab: int = VOCAB,
    hidden: int = 64,
    context: int = 64,
    eos: int = EOS,
    pad: int = PAD,
    bos: int = 1,
    eval: bool = True,
) -> torch.nn.Module:
    """A random transformers LLaMA (4 heads, 2 key/value heads, MLP twice ``hidden``)."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=context, eos_token_id=eos, pad_token_id=pad, bos_token_id=bos,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg)
    return model.eval() if eval else model


def tiny_gpt2(seed: int = 0) -> torch.nn.Module:
    """A random transformers GPT-2 (absolute position embeddings), in eval mode."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
        eos_token_id=EOS, pad_token_id=PAD, bos_token_id=1,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg).eval()


def left_padded(lengths: list[int], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of the given lengths, left-padded with PAD, tokens never EOS."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.full((len(lengths), max(lengths)), PAD)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, -n:] = torch.randint(EOS + 1, VOCAB, (n,), generator=g)
        mask[i, -n:] = 1
    return ids, mask
