"""The RLHF policy core: position ids from the mask (DPO scored left-padded pairs at the wrong
positions before it went through the core), per-token log-probabilities and entropy, and
GRPO's scoring temperature (the distribution the answers were sampled from)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from slipstream.models import GPT, GPTConfig
from slipstream.rlhf.dpo import answer_logprob_sums
from slipstream.rlhf.losses import grpo_loss
from slipstream.rlhf.policy import (
    answer_logprobs,
    clip_fraction,
    entropy_from_logits,
    output_logits,
    position_ids,
    ragged_answer_logprobs,
    ragged_chunks,
    sampling_seed,
    selective_log_softmax,
)


def _gpt() -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=48, hidden_size=32, num_layers=2, num_heads=4, max_seq_len=32)
    return GPT(cfg).eval()


def _tiny_llama() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        eos_token_id=5, pad_token_id=0, bos_token_id=1,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).eval()


def _tiny_gpt2() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=48, n_embd=32, n_layer=2, n_head=4, n_positions=32,
        eos_token_id=5, pad_token_id=0, bos_token_id=1,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg).eval()


MODELS = {"gpt": _gpt, "llama": _tiny_llama, "gpt2": _tiny_gpt2}


def _pair_padded_both_ways() -> tuple[torch.Tensor, ...]:
    """Two sequences (prompt + answer) of lengths 7 and 4 in a width of 9, right-padded and
    left-padded, with their answer masks."""
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(6, 48, (n,), generator=g) for n in (7, 4)]
    answers = [3, 2]  # the last tokens of each row are its answer
    shapes = []
    for left in (False, True):
        ids = torch.zeros(2, 9, dtype=torch.long)
        mask, answer = torch.zeros_like(ids), torch.zeros_like(ids)
        for i, (row, a) in enumerate(zip(rows, answers)):
            cols = slice(9 - len(row), 9) if left else slice(0, len(row))
            ids[i, cols], mask[i, cols] = row, 1
            end = cols.stop
            answer[i, end - a : end] = 1
        shapes.append((ids, mask, answer))
    (ri, rm, ra), (li, lm, la) = shapes
    return ri, rm, ra, li, lm, la


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_dpo_scores_a_left_padded_pair_as_its_right_padded_copy(kind):
    """Regression: DPO called the model without position ids, so a left-padded pair's tokens
    sat at shifted positions and got other log-probabilities than the same pair
    right-padded (PPO and GRPO passed them). Through the core both agree."""
    model = _gpt() if kind == "gpt" else _tiny_llama()
    ri, rm, ra, li, lm, la = _pair_padded_both_ways()
    with torch.no_grad():
        right = answer_logprob_sums(model, ri, rm, ra)
        left = answer_logprob_sums(model, li, lm, la)
        # What the old code computed for the left-padded pair: no position ids.
        out = model(input_ids=li, attention_mask=lm)
        logits = out if isinstance(out, torch.Tensor) else out.logits
        old = (selective_log_softmax(logits[:, :-1], li[:, 1:]) * la[:, 1:]).sum(1)
    torch.testing.assert_close(left, right, rtol=1e-4, atol=1e-4)
    if kind == "gpt2":
        assert (old - right).abs().max() > 1e-2  # the defect the test guards against


def test_position_ids_count_real_tokens():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert position_ids(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]


def test_log_probs_entropy_and_clip_fraction_by_hand():
    logits = torch.tensor([[[1.0, 2.0, 0.5], [0.0, 0.0, 0.0]]])
    p = F.softmax(logits, -1)
    torch.testing.assert_close(
        selective_log_softmax(logits, torch.tensor([[1, 2]])),
        torch.log(torch.stack([p[0, 0, 1], p[0, 1, 2]])).unsqueeze(0),
    )
    torch.testing.assert_close(entropy_from_logits(logits), -(p * p.log()).sum(-1))
    assert entropy_from_logits(logits)[0, 1].item() == pytest.approx(math.log(3))
    ratio = torch.tensor([[1.0, 1.3, 0.7, 1.1]])
    mask = torch.tensor([[1, 1, 1, 0]])
    assert clip_fraction(ratio, 0.2, mask).item() == pytest.approx(2 / 3)
    assert sampling_seed(7, 2, 1) == 7 + 2 * 100_003 + 7919


def test_grpo_loss_is_the_token_mean_per_answer_then_the_answer_mean():
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.2, -0.1]], requires_grad=True)
    ref = torch.tensor([[-1.1, -2.0, -0.4], [-0.3, -0.5, -0.1]])
    adv = torch.tensor([1.0, -0.5])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    out = grpo_loss(logp, adv, mask, ref_logprobs=ref, clip=0.2, kl_coef=0.1)
    d = ref - logp.detach()
    k3 = torch.exp(d) - d - 1
    per_token = -adv.unsqueeze(1) + 0.1 * k3  # ratio 1 with one update per batch
    want = ((per_token[0, :2]).mean() + per_token[1].mean()) / 2
    assert out.loss.item() == pytest.approx(want.item(), rel=1e-6)
    out.loss.backward()
    assert logp.grad is not None and logp.grad[0, 2] == 0  # the padding token has no say


def test_grpo_scores_at_the_sampling_temperature():
    """GRPO samples at ``temperature`` and scores at it too (TRL's choice): the trainer's
    old-policy log-probabilities are those of the distribution ``generate`` draws from,
    measured on 3000 one-token answers (total variation within sampling noise); the
    untempered distribution is far from what was drawn."""
    import slipstream
    from slipstream.rlhf import GRPOConfig, GRPOTrainer

    model = _tiny_llama()
    with torch.no_grad():
        model.lm_head.weight.mul_(40)  # a peaked next-token distribution, not ~uniform
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.0}},
        "hybrid_engine": {"enabled": True, "max_out_tokens": 16},
    }
    engine, *_ = slipstream.initialize(model=model, config=config)
    t = 0.5
    cfg = GRPOConfig(
        group_size=3000, max_new_tokens=1, temperature=t, top_k=0, updates_per_batch=2,
        kl_coef=0.0,
    )  # fmt: skip
    trainer = GRPOTrainer(engine, lambda p, c: [0.0] * len(c), cfg)
    prompt = torch.tensor([[7, 9, 11, 13]])
    seqs, mask, answer = trainer.generate(prompt, torch.ones_like(prompt))
    old, _ = trainer._frozen_logprobs(seqs, mask, answer)
    assert old is not None
    with torch.no_grad():
        logits = model(input_ids=prompt).logits[0, -1].float()
    drawn = torch.bincount(seqs[:, -1], minlength=logits.numel()).float() / seqs.shape[0]
    tempered, untempered = F.softmax(logits / t, -1), F.softmax(logits, -1)
    first = {}  # each sampled token's scored log-probability
    for token, lp in zip(seqs[:, -1].tolist(), old[:, 0].tolist()):
        first.setdefault(token, lp)
    for token, lp in first.items():
        assert math.exp(lp) == pytest.approx(float(tempered[token]), rel=1e-4)

    def total_variation(p: torch.Tensor) -> float:
        return 0.5 * float((drawn - p).abs().sum())

    assert total_variation(tempered) < 0.04, total_variation(tempered)  # sampling noise
    assert total_variation(untempered) > 0.08, total_variation(untempered)
    assert answer.shape == (3000, 1)
    # answer_logprobs at 1 is the untempered distribution (PPO and DPO score at 1).
    with torch.no_grad():
        _, logp1 = answer_logprobs(model, seqs[:1], mask[:1], 1)
    assert math.exp(float(logp1[0, 0])) == pytest.approx(
        float(untempered[int(seqs[0, -1])]), rel=1e-4
    )


def _ragged_batch(shared: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Six rows: left-padded prompts of 4-6 tokens in 6 columns (with ``shared``, rows 0-2
    and 3-5 repeat one prompt each, as GRPO's groups do), answers of 1-7 tokens (EOS 5
    ends all but the longest) right-padded to 7 columns."""
    from slipstream.rlhf.grpo import completion_mask

    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(6, 48, (6, 6), generator=g)
    if shared:
        prompt = prompt[[0, 0, 0, 4, 4, 4]]
    pmask = torch.ones_like(prompt)
    for row, pad in ((1, 2), (4, 1), (5, 2)) if not shared else ((3, 1), (4, 1), (5, 1)):
        pmask[row, :pad], prompt[row, :pad] = 0, 0
    answer = torch.randint(6, 48, (6, 7), generator=g)
    for row, n in enumerate((3, 7, 1, 3, 5, 2)):
        if n < 7:
            answer[row, n - 1], answer[row, n:] = 5, 0
    amask = completion_mask(answer, [5])
    return torch.cat([prompt, answer], 1), torch.cat([pmask, amask], 1), amask


def test_ragged_chunks_group_rows_of_similar_answer_length():
    _, mask, amask = _ragged_batch()
    chunks = ragged_chunks(mask, amask, per_chunk_tokens=0)  # a forward costs nothing
    assert [(c.rows.tolist(), c.start, c.answer_len) for c in chunks] == [
        ([2], 0, 1), ([5], 2, 2), ([0, 3], 0, 3), ([4], 1, 5), ([1], 2, 7)
    ]  # fmt: skip
    one = ragged_chunks(mask, amask, per_chunk_tokens=10_000)  # a forward costs everything
    assert len(one) == 1 and sorted(one[0].rows.tolist()) == list(range(6))
    assert (one[0].start, one[0].answer_len) == (0, 7)
    same = ragged_chunks(torch.ones(4, 9, dtype=torch.long), torch.ones(4, 3, dtype=torch.long))
    assert len(same) == 1 and same[0].answer_len == 3


@pytest.mark.parametrize(
    ("kind", "shared"), [("gpt", False), ("gpt", True), ("llama", False), ("llama", True)]
)
def test_ragged_answer_logprobs_equal_one_padded_forward(kind, shared):
    """Scoring in length-sorted chunks without padding columns (for Hugging Face models the
    LM head on the answer positions only, and with repeated prompts each prompt run once,
    its cache serving its answers) gives the answer tokens' log-probabilities, entropies
    and parameter gradients of one forward over the padded batch, at temperature 1 and
    below."""
    seqs, mask, amask = _ragged_batch(shared)
    for temperature in (1.0, 0.7):
        grads = []
        for ragged in (False, True):
            model = _gpt() if kind == "gpt" else _tiny_llama()
            lengths: list[int] = []
            model.register_forward_pre_hook(
                lambda m, a, k, out=lengths: out.append(k["input_ids"].shape[1]),
                with_kwargs=True,
            )
            if ragged:
                chunks = ragged_chunks(mask, amask, per_chunk_tokens=0)
                assert len(chunks) > 2  # the test exercises several chunks
                logp, entropy = ragged_answer_logprobs(
                    model, seqs, mask, amask, temperature, chunks, entropy=True
                )
                assert entropy is not None
                if kind == "llama" and shared:  # two prompts once, then answers alone
                    assert lengths == [6, 1, 2, 4, 6], lengths
                else:  # each chunk's window, its last token dropped
                    assert lengths == [6 - c.start + c.answer_len - 1 for c in chunks]
            else:
                logits, logp = answer_logprobs(model, seqs, mask, amask.shape[1], temperature)
                entropy = entropy_from_logits(logits).detach()
            m = amask.bool()
            (logp * amask).sum().backward()
            grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
            if not ragged:
                want_logp, want_entropy = logp.detach()[m], entropy[m]
        torch.testing.assert_close(logp.detach()[m], want_logp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(entropy[m], want_entropy, rtol=1e-5, atol=1e-5)
        assert len(grads[0]) == len(grads[1]) > 0
        for want, got in zip(*grads):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_ragged_scoring_pads_to_the_agreed_forward_count(kind):
    """``agree`` asking for 2 more forwards than this batch needs: two one-token forwards
    run besides the others and their backward runs too, and the log-probabilities and
    gradients are those without them."""
    seqs, mask, amask = _ragged_batch(shared=True)
    runs = []
    for extra in (0, 2):
        model = _gpt() if kind == "gpt" else _tiny_llama()
        lengths: list[int] = []
        model.register_forward_pre_hook(
            lambda m, a, k, out=lengths: out.append(k["input_ids"].shape[1]), with_kwargs=True
        )
        backwards: list[int] = []

        def count_backward(m, a, out, seen=backwards):  # a hook on the logits' gradient
            output_logits(out).register_hook(lambda g: seen.append(1))

        model.register_forward_hook(count_backward)
        asked: list[int] = []
        agree = (lambda n, e=extra, seen=asked: seen.append(n) or n + e) if extra else None
        logp, _ = ragged_answer_logprobs(model, seqs, mask, amask, agree=agree)
        (logp * amask).sum().backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        runs.append((logp.detach(), grads, lengths, len(backwards), asked))
    (logp0, grads0, lengths0, back0, _), (logp2, grads2, lengths2, back2, asked) = runs
    assert asked == [len(lengths0)]
    assert sorted(lengths2) == sorted([*lengths0, 1, 1]) and back2 == back0 + 2
    torch.testing.assert_close(logp2, logp0, rtol=0, atol=0)
    for got, want in zip(grads2, grads0, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_grpo_step_scores_ragged_answers_as_one_padded_batch():
    """GRPOTrainer in one process scores in chunks with shared prompts; three steps (two
    updates per batch, so the old policy's forward runs too) give the metrics and the
    weights of the same trainer scoring the padded batch in one forward, on the same
    ragged answers."""
    import copy

    import slipstream
    from slipstream.rlhf import GRPOConfig, GRPOTrainer

    base = _tiny_llama()
    with torch.no_grad():
        base.lm_head.weight[5] += 1.5  # EOS likely: answers of ragged lengths
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "hybrid_engine": {"enabled": True, "max_out_tokens": 24},
    }
    cfg = GRPOConfig(group_size=4, max_new_tokens=8, top_k=0, updates_per_batch=2, temperature=0.9)
    prompts = torch.tensor([[0, 7, 9, 11], [12, 14, 16, 18]])
    pmask = (prompts != 0).long()
    runs = []
    for ragged in (False, True):
        model = copy.deepcopy(base).train()
        engine, *_ = slipstream.initialize(model=model, config=config)
        trainer = GRPOTrainer(
            engine, lambda p, c: [float(len(x)) for x in c], cfg, reference=copy.deepcopy(base)
        )
        if not ragged:
            trainer._ragged = lambda: False  # type: ignore[method-assign]
        metrics = [trainer.step(prompts, pmask) for _ in range(3)]
        runs.append((metrics, [p.detach().clone() for p in model.parameters()]))
    (plain, plain_w), (chunked, chunked_w) = runs
    lengths = {m.response_length for m in plain}
    assert len(lengths) > 1 and max(lengths) < cfg.max_new_tokens  # ragged, padded
    for a, b in zip(plain, chunked):
        assert a.response_length == b.response_length  # the same answers were drawn
        for name in ("reward_mean", "kl", "entropy", "clip_fraction"):
            assert getattr(b, name) == pytest.approx(getattr(a, name), rel=1e-4, abs=1e-6)
    for a, b in zip(plain_w, chunked_w):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


@pytest.mark.rlhf_checks("grpo_ragged")
def test_grpo_ragged_scoring_at_two_zero3_ranks_equals_the_padded_forward(rlhf_world):
    """At 2 ranks with ZeRO-3 (every forward and backward gathers parameters together), each
    rank's own prompts and ragged answers need their own number of scoring forwards; the
    ranks agree on the largest, the others padding with one-token forwards. Two steps (two
    updates per batch) give the metrics and weights of the padded
    single forward on the same answers."""
    from tests.rlhf._hybrid_workloads import result

    ranks = result(rlhf_world, "grpo_ragged")
    counts = [r["ragged"]["counts"] for r in ranks]
    assert len(counts[0]) == len(counts[1]) > 0
    for (n0, agreed0), (n1, agreed1) in zip(*counts):
        assert agreed0 == agreed1 == max(n0, n1 + 1)  # rank 1 asked for one more (the check)
        assert agreed1 > n1  # so rank 1 pads at every call, rank 0 where its count is lower
    lengths = {m["response_length"] for r in ranks for m in r["padded"]["metrics"]}
    assert len(lengths) > 1  # ragged answers, different between ranks and steps
    for r in ranks:
        plain, chunked = r["padded"], r["ragged"]
        for a, b in zip(plain["metrics"], chunked["metrics"], strict=True):
            assert a["response_length"] == b["response_length"]  # the same answers drawn
            for name in ("reward_mean", "kl", "entropy", "clip_fraction"):
                assert b[name] == pytest.approx(a[name], rel=1e-4, abs=1e-6), name
        for name, want in plain["params"].items():
            torch.testing.assert_close(chunked["params"][name], want, rtol=1e-4, atol=1e-5)
