"""Generation with the KV cache: parity with full recomputation and with HF ``generate``,
reproducible sampling, streaming, and early-finishing rows."""

from __future__ import annotations

import pytest
import torch

from slipstream.config import ConfigError
from slipstream.inference import generate, stream
from tests._tiny_models import PAD, left_padded, tiny_llama

LENGTHS = [7, 3, 5, 1]
NEW = 12


@torch.no_grad()
def greedy_by_recompute(model, ids, mask, n, eos):
    """Reference: run the whole sequence through the model at every step (no cache)."""
    seq, m = ids.clone(), mask.clone()
    done = torch.zeros(len(ids), dtype=torch.bool)
    for _ in range(n):
        pos = (m.cumsum(1) - 1).clamp(min=0)
        tok = model(input_ids=seq, attention_mask=m, position_ids=pos).logits[:, -1].argmax(-1)
        tok = torch.where(done, PAD, tok)
        seq, m = torch.cat([seq, tok[:, None]], 1), torch.cat([m, torch.ones_like(m[:, :1])], 1)
        done |= torch.isin(tok, torch.tensor(eos))
        if done.all():
            break
    return seq


def early_eos(model, ids, mask) -> int:
    """A token row 0 produces at its 3rd step: as EOS it ends rows at different steps."""
    free = generate(model, input_ids=ids, attention_mask=mask, max_new_tokens=4, ignore_eos=True)
    return int(free[0, ids.shape[1] + 2])


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("finished", ["drop", "mask"])
def test_cached_greedy_equals_full_recompute_on_left_padded_batch(model, cache, finished):
    """Token for token, mixed prompt lengths, rows ending at different steps."""
    ids, mask = left_padded(LENGTHS)
    eos = early_eos(model, ids, mask)
    want = greedy_by_recompute(model, ids, mask, NEW, eos)
    got = generate(
        model, input_ids=ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=eos,
        pad_token_id=PAD, cache=cache, finished=finished,
    )  # fmt: skip
    assert torch.equal(got, want)
    assert (got[0, ids.shape[1] :] == PAD).any(), "row 0 should have ended early"


def test_cuda_graph_step_run_eagerly_equals_full_recompute(model):
    """enable_cuda_graph's decode step (static buffers, additive 4-D mask, static cache),
    run without capture on the CPU: the same tokens; rows cannot be dropped from it."""
    ids, mask = left_padded(LENGTHS)
    eos = early_eos(model, ids, mask)
    want = greedy_by_recompute(model, ids, mask, NEW, eos)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=eos,
                  pad_token_id=PAD, cache="graph")  # fmt: skip
    assert torch.equal(generate(model, finished="mask", **kwargs), want)
    with pytest.raises(ConfigError, match="finished_rows='mask'"):
        generate(model, finished="drop", **kwargs)


def test_greedy_equals_hf_generate(model):
    """Same tokens and same output shape as transformers' own generate (greedy)."""
    ids, mask = left_padded(LENGTHS, seed=4)
    eos = early_eos(model, ids, mask)
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=eos,
                  pad_token_id=PAD)  # fmt: skip
    want = model.generate(ids, **kwargs)
    assert torch.equal(generate(model, input_ids=ids, **kwargs), want)


def test_min_new_tokens_holds_eos_back(model):
    ids, mask = left_padded(LENGTHS)
    eos = early_eos(model, ids, mask)
    out = generate(model, input_ids=ids, attention_mask=mask, max_new_tokens=NEW,
                   min_new_tokens=6, eos_token_id=eos)  # fmt: skip
    assert not (out[:, ids.shape[1] : ids.shape[1] + 6] == eos).any()
    assert out.shape[1] >= ids.shape[1] + 6


def test_eos_list_ends_a_row_on_any_of_them():
    model = tiny_llama()
    ids, mask = left_padded(LENGTHS)
    free = generate(model, input_ids=ids, attention_mask=mask, max_new_tokens=6, ignore_eos=True)
    stops = [90, int(free[0, ids.shape[1] + 1]), int(free[2, ids.shape[1] + 3])]
    out = generate(model, input_ids=ids, attention_mask=mask, max_new_tokens=NEW,
                   eos_token_id=stops)  # fmt: skip
    assert torch.equal(out, greedy_by_recompute(model, ids, mask, NEW, stops))
    assert (out[:, ids.shape[1] :] == PAD).any()


def test_same_seed_same_sample_and_seed_matters():
    model = tiny_llama()
    ids, mask = left_padded(LENGTHS)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=True,
              top_k=40, top_p=0.95, temperature=1.3, repetition_penalty=1.2, ignore_eos=True)  # fmt: skip
    a, b = generate(model, seed=7, **kw), generate(model, seed=7, **kw)
    c = generate(model, generator=torch.Generator().manual_seed(7), **kw)
    assert torch.equal(a, b) and torch.equal(a, c)
    assert not torch.equal(a, generate(model, seed=8, **kw))


def test_stream_yields_the_tokens_generate_returns():
    """stream() yields [batch] per step; a HF-style streamer sees prompt, steps, end."""
    model = tiny_llama()
    ids, mask = left_padded(LENGTHS)
    eos = early_eos(model, ids, mask)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=eos,
              do_sample=True, seed=3)  # fmt: skip
    steps = list(stream(model, **kw))
    out = generate(model, **kw)
    assert torch.equal(torch.stack(steps, 1), out[:, ids.shape[1] :])

    class Recorder:
        def __init__(self):
            self.seen, self.ended = [], False

        def put(self, value):
            self.seen.append(value)

        def end(self):
            self.ended = True

    rec = Recorder()
    generate(model, streamer=rec, **kw)
    assert rec.ended and torch.equal(rec.seen[0], ids)
    assert torch.equal(torch.stack(rec.seen[1:], 1), out[:, ids.shape[1] :])


class CharTokenizer:
    """Token i decodes to chr(ord('a') + i % 26): enough to test stop strings."""

    def decode(self, ids):
        return "".join(chr(ord("a") + i % 26) for i in ids)


def test_stop_string_ends_the_row_that_produced_it():
    model = tiny_llama()
    ids, mask = left_padded([4, 4])
    free = generate(model, input_ids=ids, attention_mask=mask, max_new_tokens=8, ignore_eos=True)
    text = CharTokenizer().decode(free[0, 4:].tolist())
    stop = text[3:5]  # row 0 produces it at its 5th token
    first = text.index(stop) + len(stop)
    out = generate(model, input_ids=ids, attention_mask=mask, max_new_tokens=8, ignore_eos=True,
                   stop_strings=stop, tokenizer=CharTokenizer())  # fmt: skip
    assert torch.equal(out[0, 4 : 4 + first], free[0, 4 : 4 + first])
    assert (out[0, 4 + first :] == PAD).all()
