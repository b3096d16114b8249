"""The static-batching engine behind the serving interface: same tokens as ``generate``, per
request limits, aborts, and batch slots all free after every run."""

from __future__ import annotations

import pytest
import torch

from slipstream.inference import generate
from slipstream.inference.serving import SamplingParams, StaticBatchingEngine
from tests._tiny_models import EOS, tiny_llama

pytest.importorskip("transformers")


def _run(engine, requests):
    """Add ``requests`` ({id: (prompt, params)}), step to the end; {id: (tokens, reason)}."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    got: dict[str, list[int]] = {rid: [] for rid in requests}
    reasons: dict[str, str | None] = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id not in reasons, f"{out.request_id} produced after finishing"
            got[out.request_id] += out.new_token_ids
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    return {rid: (got[rid], reasons.get(rid)) for rid in requests}


def _reference(model, prompt, new, **kw):
    ids = torch.tensor([prompt])
    out = generate(model, input_ids=ids, max_new_tokens=new, **kw)[0, len(prompt) :].tolist()
    return out[: out.index(EOS) + 1] if EOS in out else out


def test_ragged_batch_gives_each_request_its_own_greedy_tokens_and_frees_its_slots():
    """Prompts of 3-9 tokens and answers of 2-12 tokens, batched 3 at a time: each request's
    tokens are the one-prompt greedy answer, cut at its own max_new_tokens or EOS."""
    model = tiny_llama()
    engine = StaticBatchingEngine(model, max_num_seqs=3)
    g = torch.Generator().manual_seed(0)
    requests = {}
    for i, (n, new) in enumerate([(3, 12), (9, 2), (5, 7), (4, 5), (7, 9)]):
        prompt = torch.randint(EOS + 1, 96, (n,), generator=g).tolist()
        requests[f"r{i}"] = (prompt, SamplingParams(max_new_tokens=new))
    got = _run(engine, requests)
    for rid, (prompt, params) in requests.items():
        want = _reference(model, prompt, params.max_new_tokens)
        tokens, reason = got[rid]
        assert tokens == want, rid
        assert reason == ("stop" if want[-1] == EOS else "length"), rid
    assert engine.free_blocks() == engine.total_blocks() == 3


def test_seeded_sampling_is_reproducible_and_stop_tokens_end_a_request():
    """A seeded sampled request gives the same tokens twice (it batches alone); a stop token
    ends a greedy one with reason "stop", the stop token last."""
    model = tiny_llama()
    engine = StaticBatchingEngine(model, max_num_seqs=4)
    sampled = SamplingParams(max_new_tokens=8, do_sample=True, temperature=0.9, seed=7)
    first = _run(engine, {"a": ([7, 8, 9], sampled), "b": ([10, 11], SamplingParams())})
    again = _run(engine, {"c": ([7, 8, 9], sampled)})
    assert first["a"] == again["c"]
    greedy = _reference(model, [7, 8, 9], 8, ignore_eos=True)
    stop = greedy[3]
    out = _run(engine, {"d": ([7, 8, 9], SamplingParams(max_new_tokens=8, ignore_eos=True,
                                                          stop_token_ids=(stop,)))})  # fmt: skip
    assert out["d"] == (greedy[: greedy.index(stop) + 1], "stop")


def test_abort_and_refusals_leave_no_slot_held():
    """Aborting a waiting and a running request frees everything; an over-long prompt, an
    empty prompt, an unknown token and a duplicate id are refused with ValueError."""
    model = tiny_llama()
    engine = StaticBatchingEngine(model, max_num_seqs=1)
    long = SamplingParams(max_new_tokens=40, ignore_eos=True)
    engine.add_request("run", [7, 8], long)
    engine.add_request("wait", [9, 10], long)
    outs = engine.step()
    assert [o.request_id for o in outs] == ["run"] and engine.free_blocks() == 0
    engine.abort("wait")
    engine.abort("run")
    assert not engine.has_unfinished() and engine.free_blocks() == 1
    assert engine.step() == []
    with pytest.raises(ValueError, match="max_model_len 64"):
        engine.add_request("x", [7] * 60, SamplingParams(max_new_tokens=5))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("x", [], SamplingParams())
    with pytest.raises(ValueError, match="token 96 is not in the vocabulary"):
        engine.add_request("x", [96], SamplingParams())
    engine.add_request("x", [7], SamplingParams())
    with pytest.raises(ValueError, match="already queued"):
        engine.add_request("x", [7], SamplingParams())
    while engine.has_unfinished():
        engine.step()
    assert engine.free_blocks() == engine.total_blocks()
