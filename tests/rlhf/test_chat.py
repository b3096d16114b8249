"""DeepSpeed-Chat's three steps, a few steps each on 2 ranks (tests/rlhf/_chat_workloads.py),
and the preference-data path (records, data_split, per-step examples, bad input)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from slipstream.config import ConfigError
from slipstream.rlhf import (
    PPOConfig,
    check_same_tokenizer,
    load_preference_records,
    pair_batch,
    prompt_batch,
    sft_batch,
    split_for_step,
)
from tests.rlhf._chat_workloads import EOS, PAD, CharTokenizer, records
from tests.rlhf._hybrid_workloads import result


@pytest.mark.rlhf_checks("chat")
def test_step1_sft_lowers_the_loss(rlhf_world):
    for r in result(rlhf_world, "chat"):
        losses = r["sft_losses"]
        assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.2, losses


@pytest.mark.rlhf_checks("chat")
def test_step2_reward_model_learns_the_preference(rlhf_world):
    for r in result(rlhf_world, "chat"):
        losses = r["rm_losses"]
        assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, losses
        assert losses[0] == pytest.approx(math.log(2.0), abs=0.1)  # an untrained head


@pytest.mark.rlhf_checks("chat")
def test_step3_ppo_trains_actor_and_critic_with_frozen_reference_and_reward(rlhf_world):
    """Three PPO steps, actor and critic at ZeRO-3, generation through the hybrid engine:
    finite metrics; KL exactly 0 on the first batch (actor = reference), positive after;
    the actor moved, the reference and reward model did not; the EMA moved a little, less
    than the actor."""
    for r in result(rlhf_world, "chat"):
        ppo = r["ppo"]
        assert all(m is not None for m in ppo)
        for m in ppo:
            for value in (m.reward_mean, m.kl, m.actor_loss, m.critic_loss, m.entropy):
                assert math.isfinite(value)
            assert m.response_length > 1.0
        assert ppo[0].kl == 0.0 and ppo[2].kl != 0.0
        assert r["actor_moved"] > 0 and r["reference_kept"] and r["reward_kept"]
        assert 0 < r["ema_moved"] < r["actor_moved"]


# ------------------------------------------------------------------------- data


def test_records_load_from_a_directory_with_leading_spaces(tmp_path):
    rows = [{"prompt": "Human: 31 Assistant:", "chosen": "13", "rejected": "31"}]
    (tmp_path / "train.json").write_text(json.dumps(rows))
    (tmp_path / "eval.jsonl").write_text(json.dumps(rows[0]) + "\n")
    (rec,) = load_preference_records(tmp_path)
    assert (rec.prompt, rec.chosen, rec.rejected) == (" Human: 31 Assistant:", " 13", " 31")
    assert load_preference_records(tmp_path, "eval") == [rec]


def test_missing_fields_and_files_are_named(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"prompt": "a", "chosen": "b", "rejected": "c"}, {"prompt": "a"}]))
    with pytest.raises(ConfigError, match=r"bad\.json: record 2 has no 'chosen', 'rejected'"):
        load_preference_records(bad)
    with pytest.raises(ConfigError, match=r"has no train\.json or train\.jsonl"):
        load_preference_records(tmp_path)


def test_data_split_is_disjoint_covering_and_deterministic():
    data = records(50, seed=3)
    parts = [split_for_step(data, step, "2,4,4", seed=11) for step in (1, 2, 3)]
    assert [len(p) for p in parts] == [10, 20, 20]
    ids = [id(r) for p in parts for r in p]
    assert len(set(ids)) == 50
    assert split_for_step(data, 2, "2,4,4", seed=11) == parts[1]
    assert split_for_step(data, 2, "2,4,4", seed=12) != parts[1]
    with pytest.raises(ConfigError, match="data_split='2,4'"):
        split_for_step(data, 1, "2,4")


def test_examples_follow_deepspeed_chat():
    """Step 1: prompt + chosen + EOS, labels -100 on padding only; step 2: the answer mask
    covers chosen/rejected and EOS; step 3: left-padded so every answer starts at P."""
    tok = CharTokenizer()
    recs = records(3, seed=1)
    sft = sft_batch(tok, recs, 12)
    want = [*tok.encode(recs[0].prompt + recs[0].chosen), EOS]
    assert sft.input_ids[0, : len(want)].tolist() == want
    assert (sft.labels == -100).equal(sft.attention_mask == 0)
    pairs = pair_batch(tok, recs, 12)
    n_prompt = len(tok.encode(recs[0].prompt))
    assert pairs.chosen_answer[0].tolist() == [0] * n_prompt + [1] * 6 + [0] * (6 - n_prompt)
    prompts = prompt_batch(tok, recs, 8)
    assert prompts.input_ids.shape == (3, 8)
    assert torch.all(prompts.attention_mask[:, -1] == 1)
    assert prompts.input_ids[0, : 8 - n_prompt].eq(PAD).all()


def test_data_errors_name_the_file_and_the_line(tmp_path):
    """Issue 38: 1-based lines of a .jsonl file (a blank line counted), an empty file said
    so, a truncated line named by its own number; a .json list's records 1-based."""
    good = json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"})
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join([good] * 15 + ["", json.dumps({"prompt": "a", "rejected": "c"})]))
    with pytest.raises(ConfigError, match=r"train\.jsonl: line 17 has no 'chosen'"):
        load_preference_records(data)
    data.write_text("\n".join([good] * 3 + [good[:20]] + [good] * 2) + "\n")
    with pytest.raises(ConfigError, match=r"train\.jsonl: line 4 is not valid JSON"):
        load_preference_records(data)
    for text in ("", "\n  \n"):
        data.write_text(text)
        with pytest.raises(ConfigError, match=r"train\.jsonl is empty; a record is \{"):
            load_preference_records(data)
    listed = tmp_path / "eval.json"
    listed.write_text("[]")
    with pytest.raises(ConfigError, match=r"eval\.json holds no records; a record is"):
        load_preference_records(listed)


def test_too_long_prompts_are_refused_or_dropped():
    tok, recs = CharTokenizer(), records(3, seed=1)
    with pytest.raises(ConfigError, match=r"record 1 .* 6 tokens, longer than max_prompt_len=4"):
        prompt_batch(tok, recs, 4)
    with pytest.raises(ConfigError, match="slipstream chat --drop-long-prompts"):
        prompt_batch(tok, recs, 4)
    with pytest.raises(ConfigError, match="no prompt of 3 fits"):
        prompt_batch(tok, recs, 4, drop_long_prompts=True)


def test_a_reward_tokenizer_unlike_the_actors_is_refused():
    texts = [r.prompt for r in records(2, seed=1)]
    check_same_tokenizer(CharTokenizer(), CharTokenizer(), texts)
    with pytest.raises(ConfigError, match=r"encode ' .*' differently"):
        check_same_tokenizer(CharTokenizer(), CharTokenizer(offset=4), texts)


def test_ppo_config_refuses_one_token_answers():
    with pytest.raises(ConfigError, match="max_new_tokens=1"):
        PPOConfig(max_new_tokens=1)


# ------------------------------------------------------------------ PPO extras


@pytest.mark.rlhf_checks("ppo_extras")
def test_ptx_term_adds_coef_times_the_lm_gradient_to_the_actor_update(rlhf_world):
    """Two actors, same weights and experience, SGD: the one given a PTX batch differs from
    the other by exactly -lr x ptx_coef x the gradient of the hand-written LM loss."""
    for r in result(rlhf_world, "ppo_extras"):
        assert r["start_equal"]
        assert r["with"]["ptx_loss"] == pytest.approx(r["manual_ptx_loss"], rel=1e-5)
        assert r["without"]["ptx_loss"] is None
        assert r["ptx_update_size"] > 1e-3  # the PTX term moves the weights measurably...
        assert r["ptx_update_error"] < 1e-5  # ...by exactly its share


@pytest.mark.rlhf_checks("ppo_extras")
def test_align_overflow_skips_both_steps_when_either_model_overflows(rlhf_world):
    for r in result(rlhf_world, "ppo_extras"):
        plain = r["no_align_actor_inf"]  # without the option only the actor skips
        assert plain["skipped"] and plain["actor_kept"] and not plain["critic_kept"]
        for case in ("align_actor_inf", "align_critic_inf"):
            assert r[case] == {"skipped": True, "actor_kept": True, "critic_kept": True}, case


def test_text_batch_and_chat_template():
    from slipstream.rlhf import PreferenceRecord, apply_chat_template, text_batch

    batch = text_batch(CharTokenizer(), [" 12", " 3"], 5)
    assert batch.input_ids.tolist() == [[3, 5, 6, EOS, PAD], [3, 7, EOS, PAD, PAD]]
    assert batch.labels[1].tolist() == [3, 7, EOS, -100, -100]

    class Templated(CharTokenizer):
        chat_template = "{user}"

        def apply_chat_template(self, turns, tokenize, add_generation_prompt):
            assert not tokenize and add_generation_prompt
            return f"<u>{turns[0]['content']}<a>"

    rec = PreferenceRecord(" 31:", " 13", " 31")
    assert apply_chat_template(CharTokenizer(), [rec]) == [rec]  # no template: unchanged
    (wrapped,) = apply_chat_template(Templated(), [rec])
    assert (wrapped.prompt, wrapped.chosen, wrapped.rejected) == ("<u>31:<a>", "13", "31")


def test_datasets_directories_load_or_name_the_missing_package(tmp_path):
    rows = [{"prompt": "p", "chosen": "c", "rejected": "r"}]
    (tmp_path / "dataset_info.json").write_text("{}")
    try:
        import datasets
    except ImportError:
        with pytest.raises(ConfigError, match=r"needs the 'datasets' package: pip install"):
            load_preference_records(tmp_path)
        return
    data = tmp_path / "hf"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(data))
    (rec,) = load_preference_records(data)
    assert (rec.prompt, rec.chosen, rec.rejected) == ("p", "c", "r")  # no space added
    with pytest.raises(ConfigError, match=r"splits \['train'\], not 'eval'"):
        load_preference_records(data, "eval")


@pytest.mark.rlhf_checks("empty_answers")
def test_a_rank_with_only_empty_answers_does_not_desynchronize_zero3(rlhf_world):
    """Rank 1's answers are all empty: no experience yet -> both ranks skip the step; later
    -> both reuse their previous experience and train (no hang, no divergence error)."""
    for r in result(rlhf_world, "empty_answers"):
        assert r["first"] is None
        assert r["second_trained"] and r["third_trained"]
        assert r["reused"]
