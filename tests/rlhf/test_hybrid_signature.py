"""The hybrid engine keeps the module's own ``generate`` signature (one process)."""

from __future__ import annotations

import copy

import torch

from slipstream.models import GPT, GPTConfig


def test_module_generate_keeps_gpt_generate_signature_once_hybrid_is_on():
    """Regression: ``enable_hybrid_engine_`` replaced a GPT's ``module.generate`` by the
    Hugging Face-style one, which refused ``generate(ids, n, temperature=...)`` (the demo
    worker's call) once ``hybrid_engine.enabled``. Every call GPT.generate takes now gives
    GPT.generate's tokens through the hybrid path; Hugging Face's calls still work."""
    import slipstream

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, max_seq_len=32))
    plain = copy.deepcopy(model).eval()
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.0}},
        "hybrid_engine": {"enabled": True, "max_out_tokens": 32},
    }
    engine, *_ = slipstream.initialize(model=model, config=config)
    engine.eval()
    module_generate = engine.module.generate
    ids = torch.randint(0, 64, (2, 5))
    for kwargs in ({"temperature": 0.8, "top_k": 40}, {"temperature": 0.0}, {}):
        got = module_generate(ids, 6, generator=torch.Generator().manual_seed(1), **kwargs)
        want = plain.generate(ids, 6, generator=torch.Generator().manual_seed(1), **kwargs)
        assert torch.equal(got, want), kwargs
    got = module_generate(
        input_ids=ids, max_new_tokens=6, generator=torch.Generator().manual_seed(2)
    )
    assert torch.equal(got, plain.generate(ids, 6, generator=torch.Generator().manual_seed(2)))
    assert engine.hybrid_engine.stats.calls == 4  # the hybrid path ran
    # Hugging Face's arguments still work on the module (DeepSpeed-Chat's call): greedy.
    mask = torch.ones_like(ids)
    hf_call = module_generate(ids, attention_mask=mask, max_new_tokens=6, synced_gpus=True)
    assert torch.equal(hf_call, plain.generate(ids, 6, temperature=0.0))
    # engine.generate keeps Hugging Face's arguments (greedy by default).
    hf_style = engine.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6)
    assert torch.equal(hf_style, plain.generate(ids, 6, temperature=0.0))
