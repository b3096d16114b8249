"""The continuous-batching engine on the paged KV cache: the static engine's tokens (greedy
and seeded sampling) under chunked prefill, requests joining mid-run, preemption and shared
prompt blocks; every block free after each run (finished, aborted and failed requests).

Tolerance: tokens must be equal. The paged forward batches other requests' tokens into the
same GEMMs, so logits differ from the static engine's by fp32 rounding only (checked < 1e-4
on one forward); on these random tiny models no greedy choice or draw sits that close."""

from __future__ import annotations

import pytest
import torch

from slipstream.inference import ContinuousBatchingEngine, SamplingParams, generate
from slipstream.models.gpt import GPT, GPTConfig
from tests._tiny_models import EOS, VOCAB, tiny_gpt2, tiny_llama


def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=4,
                    num_kv_heads=2, max_seq_len=64)  # fmt: skip
    return GPT(cfg).eval()


MODELS = {"gpt": tiny_gpt, "llama": tiny_llama, "gpt2": tiny_gpt2}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request: pytest.FixtureRequest) -> torch.nn.Module:
    return MODELS[request.param]()


def prompts(lengths: list[int], seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(EOS + 1, VOCAB, (n,), generator=g).tolist() for n in lengths]


def static(model, prompt: list[int], p: SamplingParams) -> list[int]:
    """The static engine's answer to one prompt (its own seeded generator)."""
    eos = () if p.ignore_eos or isinstance(model, GPT) else (EOS,)
    out = generate(
        model, input_ids=torch.tensor([prompt]), max_new_tokens=p.max_new_tokens,
        do_sample=p.do_sample, temperature=p.temperature, top_k=p.top_k or 0,
        top_p=p.top_p or 1.0, seed=p.seed, eos_token_id=list(eos) or None,
        ignore_eos=p.ignore_eos, pad_token_id=0,
    )[0, len(prompt):].tolist()  # fmt: skip
    for i, t in enumerate(out):
        if t in eos:
            return out[: i + 1]
    return out


def run(engine, requests, join_at=None):
    """Drive ``engine`` to the end; ``join_at[i]``: the step request i is added at."""
    join_at = join_at or [0] * len(requests)
    got: dict[str, list[int]] = {}
    reasons: dict[str, str | None] = {}
    step = 0
    while step <= max(join_at) or engine.has_unfinished():
        for i, (prompt, params) in enumerate(requests):
            if join_at[i] == step:
                engine.add_request(f"r{i}", prompt, params)
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        step += 1
    assert engine.free_blocks() == engine.total_blocks(), "blocks leaked"
    return got, reasons


def mixed_requests(n_new=(9, 3, 12, 6, 1)):
    lengths = [13, 1, 6, 21, 4]
    params = [
        SamplingParams(max_new_tokens=n_new[0]),
        SamplingParams(max_new_tokens=n_new[1], do_sample=True, seed=7, temperature=0.8),
        SamplingParams(max_new_tokens=n_new[2], do_sample=True, seed=8, top_k=10, top_p=0.9),
        SamplingParams(max_new_tokens=n_new[3], ignore_eos=True),
        SamplingParams(max_new_tokens=n_new[4], do_sample=True, seed=9),
    ]
    return list(zip(prompts(lengths), params, strict=True))


def test_paged_engine_gives_the_static_engines_tokens(model):
    """Chunked prefill (budget 8 tokens, blocks of 4), requests joining at steps 0-5,
    greedy and seeded sampling: each request's tokens are the static engine's alone."""
    requests = mixed_requests()
    engine = ContinuousBatchingEngine(model, block_size=4, max_tokens_per_step=8, max_num_seqs=4)
    got, reasons = run(engine, requests, join_at=[0, 0, 2, 3, 5])
    for i, (prompt, params) in enumerate(requests):
        want = static(model, prompt, params)
        assert got[f"r{i}"] == want, f"request {i}"
        assert reasons[f"r{i}"] == ("length" if len(want) == params.max_new_tokens else "stop")


def test_preemption_under_a_tiny_block_budget_keeps_the_tokens(model):
    """A pool that holds only the longest request: sequences are preempted and recomputed,
    and still give the same tokens."""
    requests = mixed_requests(n_new=(12, 12, 12, 12, 12))
    roomy = ContinuousBatchingEngine(model, block_size=4, max_tokens_per_step=16)
    want, _ = run(roomy, requests)
    tight = ContinuousBatchingEngine(model, block_size=4, num_blocks=9, max_tokens_per_step=16)
    got, _ = run(tight, requests)
    assert tight.num_preemptions > 0
    assert got == want


def test_prompt_blocks_are_shared_and_the_last_one_copied_on_write():
    model = tiny_llama()
    prompt = prompts([10])[0]  # 2 full blocks of 4 and a partial one
    engine = ContinuousBatchingEngine(model, block_size=4, max_tokens_per_step=32)
    seeds = [11, 12, 13, 14]
    for i, s in enumerate(seeds):
        engine.add_request(f"s{i}", prompt, SamplingParams(max_new_tokens=6, do_sample=True,
                                                           seed=s, ignore_eos=True))  # fmt: skip
    first = engine.step()  # the leader's prefill; the others fork its table
    assert sorted(o.request_id for o in first) == ["s0", "s1", "s2", "s3"]
    refs = engine.cache.allocator.refcount
    assert sorted(refs)[-3:] == [4, 4, 4], "3 prompt blocks shared by the 4 samples"
    assert engine.total_blocks() - engine.free_blocks() == 3
    second = engine.step()  # each sample writes into the partial block: 3 copies
    assert engine.total_blocks() - engine.free_blocks() == 2 + 4
    engine.abort("s2")
    got = {o.request_id: list(o.new_token_ids) for o in first}
    for o in second:
        got[o.request_id] += o.new_token_ids
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
            if o.request_id == "s2":
                assert o.finished and o.finish_reason == "abort"
    assert engine.free_blocks() == engine.total_blocks()
    for i, s in enumerate(seeds):
        if i != 2:
            p = SamplingParams(max_new_tokens=6, do_sample=True, seed=s, ignore_eos=True)
            assert got[f"s{i}"] == static(model, prompt, p)


def test_a_failing_forward_aborts_its_batch_and_frees_its_blocks():
    model = tiny_gpt()
    engine = ContinuousBatchingEngine(model, block_size=4)
    for i, prompt in enumerate(prompts([5, 9, 9])):
        engine.add_request(f"f{i}", prompt, SamplingParams(max_new_tokens=4))
    engine.step()
    calls = {"n": 0}

    def boom(*_a, **_k):
        calls["n"] += 1
        raise RuntimeError("injected failure")

    handle = model.layers[1].mlp.register_forward_pre_hook(boom)
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    handle.remove()
    outs = engine.step()
    assert {o.finish_reason for o in outs} == {"abort"} and len(outs) == 3
    assert not engine.has_unfinished()
    assert engine.free_blocks() == engine.total_blocks()


def test_requests_that_cannot_fit_are_refused_at_add_time():
    engine = ContinuousBatchingEngine(tiny_gpt(), block_size=4, num_blocks=3)
    assert engine.max_model_len == 64
    with pytest.raises(ValueError, match="max_model_len=64"):
        engine.add_request("a", [7] * 60, SamplingParams(max_new_tokens=5))
    with pytest.raises(ValueError, match="the pool has 3"):
        engine.add_request("b", [7] * 10, SamplingParams(max_new_tokens=5))
    engine.add_request("c", [7] * 4, SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="already running"):
        engine.add_request("c", [7] * 4, SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="not a token id"):
        engine.add_request("d", [VOCAB], SamplingParams())
    with pytest.raises(ValueError, match="not a token id"):
        engine.add_request("d", [7, "8"], SamplingParams())
    engine.add_request("e", [torch.tensor(7), 8], SamplingParams(max_new_tokens=1))  # 0-d ints


def test_paged_forward_logits_match_the_models_own_forward(model):
    """The tolerance behind token equality: a prompt in two prefill chunks through the
    paged forward gives the model's own logits to 1e-4."""
    engine = ContinuousBatchingEngine(model, block_size=4, num_blocks=8)
    ids = prompts([11])[0]
    cache, table = engine.cache, []
    cache.grow(table, len(ids))
    slots = cache.slots(table, 0, len(ids))
    got = []
    with torch.no_grad():
        for start, end in ((0, 6), (6, 11)):
            cache.layout = cache.plan([], [(slots[:end], start)])
            ids_t, pos = torch.tensor(ids[start:end]), torch.arange(start, end)
            got.append(engine.runner.logits(engine.runner.hidden(ids_t, pos, cache)))
        want = (
            model(torch.tensor([ids])).logits
            if not isinstance(model, GPT)
            else model(torch.tensor([ids]))
        )
    torch.testing.assert_close(torch.cat(got), want[0], rtol=0, atol=1e-4)


def test_a_left_padded_batch_with_copies_runs_paged_with_shared_prompts(monkeypatch):
    """The RLHF rollout path: a request of 2 prompts x 3 copies (left-padded) gives the
    static loop's greedy output, forks each prompt's blocks for its 2 other copies, and
    samples reproducibly from per-row generators."""
    from slipstream.inference.generation import run as static_run
    from slipstream.inference.paged import PagedKVCache
    from slipstream.inference.paged_generate import paged_refusal, run_paged
    from slipstream.inference.request import build_request

    model = tiny_llama()
    ids = torch.tensor([[0, 0, 0, 9, 17, 33], [41, 8, 12, 50, 7, 66]])
    mask = (ids != 0).long()
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=7, num_return_sequences=3)
    forks = []
    real_fork = PagedKVCache.fork
    monkeypatch.setattr(PagedKVCache, "fork", lambda self, t: forks.append(1) or real_fork(self, t))
    req = build_request(model, {**kwargs, "do_sample": False})
    assert paged_refusal(model, req) is None
    assert torch.equal(run_paged(model, req), static_run(model, req))
    assert len(forks) == 4
    sampled = [run_paged(model, build_request(model, {**kwargs, "do_sample": True, "seed": 5}))
               for _ in range(2)]  # fmt: skip
    assert torch.equal(sampled[0], sampled[1])
    assert not torch.equal(sampled[0][0], sampled[0][1]), "copies draw independently"


def _state(engine: ContinuousBatchingEngine, rid: str) -> str:
    """Where request ``rid`` is in the scheduler (read from its private queues)."""
    seq = engine._seqs[rid]
    if seq in engine._waiting:
        return "preempted" if seq.generated else "waiting"
    if seq in engine._running:
        return "decoding" if seq.generated else "prefilling"
    return "follower"


# (request aborted, step it is aborted before, where it is then) under a 8-block pool.
ABORTS = [
    ("g0", 0, "waiting"),  # a group's leader before its prefill: a follower inherits
    ("g0", 1, "prefilling"),  # the leader mid-prefill (9 tokens, budget 8): the heir resumes
    ("g1", 1, "follower"),
    ("long", 2, "prefilling"),
    ("g2", 3, "preempted"),  # freed by preemption, waiting to be recomputed
    ("g0", 4, "decoding"),  # its prompt blocks shared with the group's forks
    ("short", 4, "waiting"),  # never admitted: the pool is full of the others
]


def test_aborts_in_every_scheduler_state_free_all_blocks_and_spare_the_others():
    """A tiny pool (8 blocks of 4, preemption on), a group of 3 sharing a prompt and two
    others: aborting one request while it waits, prefills, follows its group's leader,
    decodes or sits preempted frees every block by the end, and every other request still
    gets the tokens of a run with no abort (the aborted one a prefix of its own)."""
    model = tiny_llama()
    shared, long, short = prompts([9, 13, 6], seed=5)
    requests = {
        "g0": (shared, SamplingParams(max_new_tokens=8, do_sample=True, seed=1, ignore_eos=True)),
        "g1": (shared, SamplingParams(max_new_tokens=8, do_sample=True, seed=2, ignore_eos=True)),
        "g2": (shared, SamplingParams(max_new_tokens=8, ignore_eos=True)),
        "long": (long, SamplingParams(max_new_tokens=8, ignore_eos=True)),
        "short": (short, SamplingParams(max_new_tokens=8, ignore_eos=True)),
    }
    want, _ = run(ContinuousBatchingEngine(model, block_size=4, max_tokens_per_step=8),
                  list(requests.values()))  # fmt: skip
    want = {rid: want[f"r{i}"] for i, rid in enumerate(requests)}
    for victim, at, where in ABORTS:
        engine = ContinuousBatchingEngine(model, block_size=4, num_blocks=8, max_tokens_per_step=8)
        for rid, (prompt, params) in requests.items():
            engine.add_request(rid, prompt, params)
        got: dict[str, list[int]] = {rid: [] for rid in requests}
        reasons: dict[str, str | None] = {}
        step = 0
        while engine.has_unfinished():
            if step == at:
                assert _state(engine, victim) == where, (victim, at)
                engine.abort(victim)
            for out in engine.step():
                got[out.request_id].extend(out.new_token_ids)
                if out.finished:
                    reasons[out.request_id] = out.finish_reason
            step += 1
        assert engine.free_blocks() == engine.total_blocks(), f"blocks leaked: {victim} {where}"
        assert reasons[victim] == "abort" and got[victim] == want[victim][: len(got[victim])]
        for rid in requests.keys() - {victim}:
            assert got[rid] == want[rid], (victim, where, rid)
