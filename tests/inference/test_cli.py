"""`slipstream generate`: a tiny saved model with a word-level tokenizer and chat template."""

from __future__ import annotations

from pathlib import Path

import pytest

from slipstream.cli.main import main
from slipstream.inference import generate
from tests._tiny_models import EOS, VOCAB, tiny_llama
from tests.distributed.harness import run_cli

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = (
    "{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<s> assistant {% endif %}"
)


def _save(tmp_path):
    words = ["<pad>", "<s>", "user", "system", "assistant", "</s>"]
    words += [f"w{i}" for i in range(VOCAB - len(words))]
    core = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>")
    )
    core.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="</s>", pad_token="<pad>", bos_token="<s>"
    )
    tok.chat_template = TEMPLATE
    model = tiny_llama()
    assert tok.eos_token_id == EOS
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    return model, tok


def test_generate_streams_the_chat_answer_and_reports_speed(tmp_path, capsys):
    model, tok = _save(tmp_path)
    capsys.readouterr()  # saving may import an installed DeepSpeed (accelerate), which logs to stdout
    code = main(["generate", str(tmp_path), "--prompt", "w3 w9 w40", "--max-new-tokens", "6"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "tokens/s" in err
    text = tok.apply_chat_template(
        [{"role": "user", "content": "w3 w9 w40"}], tokenize=False, add_generation_prompt=True
    )
    ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids
    assert ids[0, 0] == 1 and ids[0, 1] == 2  # "<s> user": the template was applied
    want = generate(model, input_ids=ids, max_new_tokens=6)[0, ids.shape[1] :].tolist()
    if EOS in want:
        want = want[: want.index(EOS)]
    assert out.strip() == tok.decode(want, skip_special_tokens=True).strip()
    assert f"[{len(want)} tokens" in err


def _chat_ids(tok, prompt):
    text = tok.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    return tok(text, return_tensors="pt", add_special_tokens=False).input_ids


@pytest.mark.slow  # two interpreters start (the 2 ranks; the launcher is forked warm)
def test_generate_on_two_tensor_parallel_ranks(tmp_path):
    """--tp 2 launches two ranks the way `slipstream run` does; rank 0 prints the answer,
    which is the one-process answer."""
    model, tok = _save(tmp_path)
    proc = run_cli(
        ["generate", str(tmp_path), "--prompt", "w3 w9 w40", "--max-new-tokens", "6", "--tp",
         "2", "--temperature", "0.9", "--seed", "5"],
        cwd=ROOT, timeout_s=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    ids = _chat_ids(tok, "w3 w9 w40")
    want = generate(model, input_ids=ids, max_new_tokens=6, do_sample=True, temperature=0.9,
                    seed=5)[0, ids.shape[1] :].tolist()  # fmt: skip
    if EOS in want:
        want = want[: want.index(EOS)]
    assert proc.stdout.strip() == tok.decode(want, skip_special_tokens=True).strip()
    assert proc.stderr.count("tokens/s") == 1, proc.stderr  # rank 0 only
    assert f"[{len(want)} tokens" in proc.stderr and "2 tensor-parallel ranks" in proc.stderr


def test_generate_refuses_a_tp_size_not_dividing_the_heads(tmp_path, capsys):
    _save(tmp_path)
    code = main(["generate", str(tmp_path), "--prompt", "w3", "--tp", "3"])
    err = capsys.readouterr().err
    assert code == 2 and "tp_size=3 does not divide" in err and "num_attention_heads=4" in err


def test_generate_rejects_a_missing_model(tmp_path, capsys):
    code = main(["generate", str(tmp_path / "nope"), "--prompt", "hi"])
    assert code == 2 and "neither a model directory" in capsys.readouterr().err


def test_int8_quant_flag(tmp_path, capsys):
    _save(tmp_path)
    code = main(["generate", str(tmp_path), "--prompt", "w3", "--quant", "w8a8-int",
                 "--max-new-tokens", "3"])  # fmt: skip
    assert code == 0 and "tokens/s" in capsys.readouterr().err
