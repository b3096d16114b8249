"""``slipstream chat``: the three DeepSpeed-Chat steps end to end on a tiny reference GPT (one
process, through the command line), and bad input refused before any training."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from slipstream.cli.main import main
from tests.distributed.harness import run_cli
from tests.rlhf._chat_workloads import records, saved_state

SMALL = [
    "--batch-size", "2", "--max-seq-len", "12", "--max-prompt-len", "6",
    "--max-answer-len", "4", "--sft-lr", "1e-2", "--reward-lr", "1e-2",
    "--actor-lr", "1e-3", "--critic-lr", "1e-3",
]  # fmt: skip


def _write_data(directory: Path, n: int) -> Path:
    rows = [{"prompt": r.prompt[1:], "chosen": r.chosen[1:], "rejected": r.rejected[1:]}
            for r in records(n, seed=5)]  # fmt: skip
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "train.json").write_text(json.dumps(rows))
    return directory


def _state(directory: Path) -> dict[str, torch.Tensor]:
    return saved_state(directory)


def test_chat_runs_all_three_steps_on_a_tiny_gpt(tmp_path, capsys):
    data, out = _write_data(tmp_path / "data", 20), tmp_path / "out"
    cmd = ["chat", "--actor", "gpt:tiny", "--reward", "gpt:tiny", "--data", str(data),
           "--output", str(out), "--step", "all", "--step2-epochs", "2", *SMALL]  # fmt: skip
    done = run_cli(cmd, timeout_s=240)  # the command in a process of its own, forked warm
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    # 20 records, 2,4,4 split: 4 / 8 / 8 records at 2 per step -> 2, 2 x 4 and 4 steps.
    rows = {
        k: [json.loads(x) for x in (out / f).read_text().splitlines()]
        for k, f in (("sft", "step1_sft/metrics.jsonl"), ("rm", "step2_reward/metrics.jsonl"),
                     ("ppo", "step3_rlhf/ppo.jsonl"))
    }  # fmt: skip
    assert [len(rows[k]) for k in ("sft", "rm", "ppo")] == [2, 8, 4]
    assert [r["epoch"] for r in rows["rm"]] == [0] * 4 + [1] * 4
    assert summary["step2_accuracy"] == rows["rm"][-1]["accuracy"]
    assert rows["rm"][0]["loss"] == pytest.approx(math.log(2.0), abs=0.1)  # a new value head
    assert rows["ppo"][0]["kl"] == 0.0  # the actor starts as the reference (the SFT model)
    assert all(math.isfinite(r["reward_mean"]) and math.isfinite(r["kl"]) for r in rows["ppo"])
    # Step 3 starts from step 1's actor and step 2's reward model and trains both copies.
    sft, rm = _state(out / "step1_sft"), _state(out / "step2_reward")
    actor, critic = _state(out / "step3_rlhf/actor"), _state(out / "step3_rlhf/critic")
    assert set(actor) == set(sft) and "v_head.weight" in rm and set(critic) == set(rm)
    assert any(not torch.equal(actor[k], sft[k]) for k in sft)
    assert any(not torch.equal(critic[k], rm[k]) for k in rm)
    assert (out / "step2_reward/v_head.pt").is_file() and not (out / "step1_sft/v_head.pt").exists()
    _evaluate_quantize_and_generate(tmp_path, out / "step3_rlhf/actor", capsys)
    pytest.importorskip("matplotlib")
    assert [p.name for p in (out / "step3_rlhf/plots").iterdir()] == ["summary.png"]


def _evaluate_quantize_and_generate(tmp_path: Path, actor: Path, capsys) -> None:
    """Regression: ``slipstream chat`` saved ``slipstream_gpt.json`` + ``model.pt``, which
    neither ``slipstream quant eval`` (it read ``gpt_config.json`` + ``model.safetensors``) nor
    ``slipstream generate`` (Hugging Face models only) could read. Both read what chat saves
    now, with its character tokenizer."""
    from slipstream.models.files import load_gpt, load_tokenizer

    tok = load_tokenizer(actor)
    text = " ".join(r.prompt + r.chosen for r in records(6, seed=9))
    (tmp_path / "eval.txt").write_text(text)
    capsys.readouterr()
    rc = main(["quant", "eval", str(actor), "--text", str(tmp_path / "eval.txt"), "--seq-len",
               "12", "--configs", "fp32,w8a8-int"])  # fmt: skip
    out = capsys.readouterr()
    assert rc == 0, out.err[-2000:]
    rows = [line.split() for line in out.out.splitlines()]
    ppl = {r[0]: float(r[1]) for r in rows if r and r[0] in ("fp32", "w8a8-int")}
    assert set(ppl) == {"fp32", "w8a8-int"} and all(math.isfinite(v) for v in ppl.values())
    # A sane model: about uniform over the vocabulary or better after 2 SFT and 4 PPO steps
    # (14.07 with the paged engine's rollouts, below 14 with the static loop's draws).
    assert ppl["fp32"] < 1.05 * tok.vocab_size
    prompt = records(1, seed=3)[0].prompt
    generate = ["generate", str(actor), "--prompt", prompt, "--max-new-tokens", "4"]
    assert main([*generate, "--quant", "w8a8-int-attn-float"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert main(generate) == 0
    shown = capsys.readouterr().out
    model = load_gpt(actor).eval()
    ids = torch.tensor([tok.encode(prompt)])
    greedy = model.generate(ids, 4, temperature=0.0)[0, ids.shape[1] :].tolist()
    end = greedy.index(1) if 1 in greedy else len(greedy)  # the character tokenizer's EOS
    assert shown.strip() == tok.decode(greedy[:end]).strip()


def _chat(tmp_path: Path, *args: str, capsys: pytest.CaptureFixture[str]) -> str:
    argv = ["chat", "--output", str(tmp_path / "out"), *SMALL, *args]
    assert main(argv) == 2
    assert not (tmp_path / "out").exists()  # refused before any step started
    return " ".join(capsys.readouterr().err.split())


def test_chat_refuses_records_missing_keys(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.json").write_text(json.dumps([{"prompt": "12:", "chosen": "12"}]))
    err = _chat(tmp_path, "--actor", "gpt:tiny", "--reward", "gpt:tiny", "--data", str(data),
                capsys=capsys)  # fmt: skip
    assert "train.json: record 1 has no 'rejected'" in err


def test_chat_refuses_a_reward_tokenizer_unlike_the_actors(tmp_path, capsys):
    from slipstream.models.gpt import GPT, GPTConfig
    from slipstream.rlhf.e2e import CharTokenizer, save_model

    data = _write_data(tmp_path / "data", 20)
    other = CharTokenizer(" 0123456789:"[::-1])  # the same characters, other ids
    reward_dir = tmp_path / "reward_lm"
    save_model(GPT(GPTConfig.preset("tiny", vocab_size=other.vocab_size)), other, reward_dir)
    err = _chat(tmp_path, "--actor", "gpt:tiny", "--reward", str(reward_dir), "--data",
                str(data), capsys=capsys)  # fmt: skip
    assert "the reward and actor tokenizers encode" in err and "same tokenizer" in err


def test_chat_refuses_step3_without_a_trained_reward_model_and_unknown_models(tmp_path, capsys):
    data = _write_data(tmp_path / "data", 20)
    err = _chat(tmp_path, "--actor", "gpt:tiny", "--reward", "gpt:tiny", "--data", str(data),
                "--step", "3", capsys=capsys)  # fmt: skip
    assert "step 3 needs a trained reward model" in err
    err = _chat(tmp_path, "--actor", str(tmp_path), "--data", str(data), "--step", "1",
                capsys=capsys)  # fmt: skip
    assert "is neither a Hugging Face model directory (no config.json)" in err
