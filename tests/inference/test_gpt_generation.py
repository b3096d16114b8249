"""The reference GPT's KV cache: cached generation equals recomputing the sequence each step."""

from __future__ import annotations

import re

import pytest
import torch

from slipstream.config import ConfigError
from slipstream.inference import init_inference, stream
from slipstream.models import GPT, GPTConfig
from tests._tiny_models import EOS, VOCAB, left_padded

LENGTHS = [3, 9, 6]
NEW = 10


def tiny_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig.preset("tiny", vocab_size=VOCAB)).eval()


def recomputed_greedy(model: GPT, ids: torch.Tensor, mask: torch.Tensor, new: int) -> list:
    """Each row alone, unpadded, through the plain forward over the whole sequence per step."""
    rows = []
    for row, keep in zip(ids, mask.bool()):
        seq = row[keep].unsqueeze(0)
        start = seq.shape[1]
        with torch.no_grad():
            for _ in range(new):  # no cache: the training forward over the whole sequence
                seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], 1)
        rows.append(seq[0, start:].tolist())
    return rows


def test_cached_logits_equal_the_full_forward():
    model = tiny_gpt()
    ids = torch.randint(EOS + 1, VOCAB, (2, 12))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_kv_cache(12)
        chunks = [model(ids[:, :5], kv_cache=cache)]
        chunks += [model(ids[:, i : i + 1], kv_cache=cache) for i in range(5, 12)]
    assert cache.length == 12
    torch.testing.assert_close(torch.cat(chunks, 1), full, rtol=1e-5, atol=1e-5)


def test_greedy_with_the_cache_equals_recomputing_each_step():
    """Left-padded rows of mixed lengths, batched against the cache, give the tokens each
    row gets alone through the no-cache forward; after the prompt the model only ever sees
    one new token per row (the cache is really used)."""
    model = tiny_gpt()
    ids, mask = left_padded(LENGTHS)
    seen: list[tuple[int, ...]] = []
    hook = model.embed_tokens.register_forward_hook(lambda m, a, o: seen.append(a[0].shape))
    engine = init_inference(model, kv_cache="dynamic")  # the static loop on the GPT cache
    out = engine.generate(ids, attention_mask=mask, max_new_tokens=NEW)
    hook.remove()
    assert out[:, : ids.shape[1]].equal(ids)
    assert out[:, ids.shape[1] :].tolist() == recomputed_greedy(model, ids, mask, NEW)
    assert seen[0] == ids.shape and all(s == (len(LENGTHS), 1) for s in seen[1:]), seen
    assert len(seen) == NEW  # prefill + NEW - 1 decode steps


def test_finished_rows_dropped_or_masked_match_the_reference():
    model = tiny_gpt()
    ids, mask = left_padded(LENGTHS)
    engine = init_inference(model)
    free = engine.generate(ids, attention_mask=mask, max_new_tokens=NEW)
    eos = int(free[1, ids.shape[1] + 2])  # row 1 ends at its third token
    ref = recomputed_greedy(model, ids, mask, NEW)
    for finished in ("drop", "mask"):
        got = init_inference(model, finished_rows=finished).generate(
            ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=0
        )
        for row, want in zip(got[:, ids.shape[1] :].tolist(), ref):
            n = want.index(eos) + 1 if eos in want else NEW
            assert row[:n] == want[:n] and set(row[n:]) <= {0}, (finished, row, want)
    assert got.shape[1] <= free.shape[1]


def test_stream_and_seeded_sampling():
    model = tiny_gpt()
    ids, mask = left_padded(LENGTHS)
    engine = init_inference(model)
    kw = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=True, top_k=20, top_p=0.9)
    first = engine.generate(ids, seed=3, **kw)
    assert engine.generate(ids, seed=3, **kw).equal(first)
    assert not engine.generate(ids, seed=4, **kw).equal(first)
    streamed = torch.stack(list(stream(engine, ids, seed=3, **kw)), 1)
    assert streamed.equal(first[:, ids.shape[1] :])


def test_bad_requests_are_refused_before_any_work():
    model = tiny_gpt()  # max_seq_len 64
    engine = init_inference(model)
    ids = torch.full((1, 60), EOS + 1)
    with pytest.raises(ConfigError, match="more than the model's context of 64"):
        engine.generate(ids, max_new_tokens=8)
    with pytest.raises(ValueError, match="attention_mask has shape"):
        model(ids, attention_mask=torch.ones(1, 3), kv_cache=model.new_kv_cache(64))


def test_int8_attention_core_is_refused_for_generation():
    from slipstream.quant import W8A8Int

    engine = init_inference(tiny_gpt(), quant=W8A8Int())
    with pytest.raises(ConfigError, match=r"layers\.0\.attn is .*HeroModes\(attn_core=False\)"):
        engine.generate(torch.tensor([[7, 8, 9]]), max_new_tokens=2)


@pytest.mark.parametrize("bad", [VOCAB, VOCAB + 7, -1])
def test_token_id_outside_the_vocabulary_is_refused_up_front(bad: int) -> None:
    """Issue 38: an id >= the vocabulary size (or negative) was a bare IndexError from the
    embedding; both generate paths name the position, the id and the vocabulary."""
    model = tiny_gpt()
    ids = torch.tensor([[1, 2, 3], [4, bad, 5]])
    want = f"input_ids[1, 1] = {bad} is not a token of this model (vocabulary of {VOCAB}"
    with pytest.raises(ConfigError, match=re.escape(want)):
        init_inference(model).generate(ids, max_new_tokens=2)
    with pytest.raises(ValueError, match=re.escape(want)):
        model.generate(ids, 2)
