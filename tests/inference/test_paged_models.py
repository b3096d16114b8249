"""The paged forwards of more Hugging Face model types (OPT, Qwen2, Mistral, Qwen3: tiny
random configs), the fused and packed LLaMA-family projections, and ``init_inference``'s
``generate`` on the continuous-batching engine.

Token equality with the static engine holds because the paged forward's logits agree with
the model's own to 1e-4 (checked here too); the packed GEMMs only change summation order.
"""

from __future__ import annotations

import functools

import pytest
import torch

from slipstream.config import ConfigError
from slipstream.inference import ContinuousBatchingEngine, init_inference
from tests._tiny_models import EOS, PAD, VOCAB, left_padded
from tests.inference.test_batching import mixed_requests, prompts, run, static


def _hf(kind: str) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  eos_token_id=EOS, pad_token_id=PAD, bos_token_id=1)  # fmt: skip
    if kind == "opt":
        cfg = transformers.OPTConfig(**common, ffn_dim=128, max_position_embeddings=64,
                                     word_embed_proj_dim=64)  # fmt: skip
        return transformers.OPTForCausalLM(cfg).eval()
    llama = dict(common, intermediate_size=128, num_key_value_heads=2, max_position_embeddings=64)
    if kind == "qwen2":  # q/k/v biases
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**llama)).eval()
    if kind == "mistral":  # a sliding window longer than these sequences
        cfg = transformers.MistralConfig(**llama, sliding_window=48)
        return transformers.MistralForCausalLM(cfg).eval()
    cfg = transformers.Qwen3Config(**llama, head_dim=16)  # q/k norms per head
    return transformers.Qwen3ForCausalLM(cfg).eval()


@pytest.mark.parametrize("kind", ["opt", "qwen2", "mistral", "qwen3"])
def test_paged_forward_gives_the_static_engines_tokens(kind):
    """Chunked prefill, requests joining late, greedy and seeded sampling: the static
    engine's tokens per request; and the paged logits equal the model's own to 1e-4."""
    model = _hf(kind)
    requests = mixed_requests()
    engine = ContinuousBatchingEngine(model, block_size=4, max_tokens_per_step=8, max_num_seqs=4)
    assert (engine.runner.fused is not None) == (kind != "opt")
    got, _ = run(engine, requests, join_at=[0, 0, 2, 3, 5])
    for i, (prompt, params) in enumerate(requests):
        assert got[f"r{i}"] == static(model, prompt, params), f"request {i}"
    ids = prompts([11])[0]
    cache, table = engine.cache, []
    cache.grow(table, len(ids))
    cache.layout = cache.plan([], [(cache.slots(table, 0, len(ids)), 0)])
    with torch.no_grad():
        paged = engine.runner.logits(
            engine.runner.hidden(torch.tensor(ids), torch.arange(11), cache)
        )
        want = model(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(paged, want, rtol=0, atol=1e-4)


def test_packed_weights_follow_a_weight_update():
    """The fused, packed projections are rebuilt when a weight changes in place, so an
    engine built before a training step never decodes with stale weights."""
    model = _hf("qwen2")
    engine = ContinuousBatchingEngine(model, block_size=4)
    params = mixed_requests()[0][1]
    prompt = prompts([9])[0]
    before, _ = run(engine, [(prompt, params)])
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(-3.0)
        model.model.layers[1].self_attn.k_proj.bias.add_(1.0)
    after, _ = run(engine, [(prompt, params)])
    assert after["r0"] == static(model, prompt, params)
    assert after != before


def test_init_inference_generate_runs_greedy_requests_paged():
    """``kv_cache`` auto (the default) gives the static engine's and HF ``generate``'s greedy
    tokens on a left-padded batch; 'paged' refuses what it cannot run, naming why."""
    model = _hf("mistral")
    ids, mask = left_padded([3, 7, 5, 6])
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=9, pad_token_id=PAD)
    engine = init_inference(model)
    calls = []
    real = engine._runner
    engine._runner = lambda: calls.append(1) or real()  # type: ignore[method-assign]
    auto = engine.generate(**kwargs)
    assert calls, "the paged engine did not run"
    dynamic = init_inference(model, kv_cache="dynamic").generate(**kwargs)
    with torch.inference_mode():
        hf = model.generate(**kwargs, do_sample=False)
    assert torch.equal(auto, dynamic)
    assert torch.equal(auto, hf)
    paged = init_inference(model, kv_cache="paged")
    assert torch.equal(paged.generate(**kwargs), auto)
    with pytest.raises(ConfigError, match=r"kv_cache='paged' cannot run.*sampled"):
        paged.generate(**kwargs, do_sample=True, seed=1)
    sampled = engine.generate(**kwargs, do_sample=True, seed=1)  # auto: the static loop
    assert torch.equal(sampled, init_inference(model, kv_cache="dynamic").generate(
        **kwargs, do_sample=True, seed=1))  # fmt: skip
    # Why sampled requests stay there: from the global RNG they draw HF generate's tokens.
    torch.manual_seed(5)
    unseeded = engine.generate(**kwargs, do_sample=True, temperature=0.9, top_k=40)
    torch.manual_seed(5)
    with torch.inference_mode():
        hf = model.generate(**kwargs, do_sample=True, temperature=0.9, top_k=40)
    assert torch.equal(unseeded, hf)
    assert not torch.equal(unseeded, auto)


def test_auto_keeps_bf16_models_on_the_static_loop():
    """``kv_cache`` auto picks the paged engine only where it measured faster (fp32 on the
    CPU); a bf16 model runs the static loop, 'paged' still runs it paged."""
    model = _hf("mistral").to(torch.bfloat16)
    ids, mask = left_padded([3, 7])
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, pad_token_id=PAD)
    for cache, want in (("auto", False), ("paged", True)):
        engine = init_inference(model, kv_cache=cache, dtype="bf16")
        calls: list[int] = []
        engine._runner = functools.partial(_counted, engine._runner, calls)  # type: ignore[method-assign]
        engine.generate(**kwargs)
        assert bool(calls) is want, cache


def _counted(real, calls, *args):
    calls.append(1)
    return real(*args)
