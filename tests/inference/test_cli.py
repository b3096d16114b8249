"""`slipstream generate`: a tiny saved model with a word-level tokenizer and chat template."""

from __future__ import annotations

import pytest

from slipstream.cli.main import main
from slipstream.inference import generate
from tests.inference.conftest import EOS, VOCAB, tiny_llama

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

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


def test_generate_refuses_tensor_parallel_for_now(tmp_path, capsys):
    _save(tmp_path)
    code = main(["generate", str(tmp_path), "--prompt", "w3", "--tp", "2"])
    assert code == 2 and "tp_size=2 is not supported yet" in capsys.readouterr().err


def test_generate_rejects_a_missing_model(tmp_path, capsys):
    code = main(["generate", str(tmp_path / "nope"), "--prompt", "hi"])
    assert code == 2 and "neither a model directory" in capsys.readouterr().err


def test_int8_quant_flag(tmp_path, capsys):
    _save(tmp_path)
    code = main(["generate", str(tmp_path), "--prompt", "w3", "--quant", "w8a8-int",
                 "--max-new-tokens", "3"])  # fmt: skip
    assert code == 0 and "tokens/s" in capsys.readouterr().err
