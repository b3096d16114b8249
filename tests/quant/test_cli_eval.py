"""`slipstream quant eval`: perplexity / cosine tables for tiny in-test models via cli.main."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import save_file

from slipstream.cli.main import main
from slipstream.models import GPT, GPTConfig
from slipstream.models.files import GPT_CONFIG_FILE
from slipstream.quant import perplexity

TEXT = "The quick brown fox jumps over the lazy dog. " * 3


def _rows(out: str) -> dict[str, list[float]]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("config "))
    rows = {}
    for line in lines[start + 1 :]:
        parts = line.split()
        if parts and not line.startswith("("):
            rows[parts[0]] = [float(v) for v in parts[1:]]
    return rows


def test_quant_eval_gpt_perplexity_table(tmp_path, capsys) -> None:
    """A saved tiny GPT gets one perplexity row per config; fp32 equals perplexity() directly."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny")).eval()
    (tmp_path / GPT_CONFIG_FILE).write_text(json.dumps(dataclasses.asdict(model.config)))
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "model.safetensors"
    )
    (tmp_path / "t.txt").write_text(TEXT)
    args = ["quant", "eval", str(tmp_path), "--text", str(tmp_path / "t.txt"), "--seq-len", "32"]
    rc = main([*args, "--configs", "fp32,w8a8-int,w4a8-fp4", "--group-size", "32"])
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = _rows(out)
    assert list(rows) == ["fp32", "w8a8-int", "w4a8-fp4"]
    ids = torch.tensor(list(TEXT.encode()), dtype=torch.long)
    assert rows["fp32"][0] == pytest.approx(perplexity(model, ids, 32), abs=1e-4)
    assert rows["w8a8-int"][0] == pytest.approx(rows["fp32"][0], rel=0.05)


def test_quant_eval_unknown_config_is_an_error(tmp_path, capsys) -> None:
    """An unknown row name exits 2 and lists the valid names."""
    (tmp_path / "t.txt").write_text(TEXT)
    rc = main(
        ["quant", "eval", str(tmp_path), "--text", str(tmp_path / "t.txt"), "--configs", "w9"]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "unknown quantization config(s) ['w9']" in err and "w8a8-fp8" in err


def test_quant_eval_encoder_cosine_table(tmp_path, capsys) -> None:
    """A tiny HF BERT (auto-detected encoder): fp32 row has cosine 1, W8A8 close to 1."""
    transformers = pytest.importorskip("transformers")
    words = sorted(set(TEXT.lower().replace(".", " .").split()))
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    transformers.BertTokenizerFast(str(tmp_path / "vocab.txt")).save_pretrained(tmp_path)
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=len(vocab), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=32, architectures=["BertModel"],
    )  # fmt: skip
    transformers.BertModel(cfg).save_pretrained(tmp_path)
    (tmp_path / "s.txt").write_text("the quick brown fox\nthe lazy dog .\njumps over the dog\n")
    args = ["quant", "eval", str(tmp_path), "--text", str(tmp_path / "s.txt")]
    rc = main([*args, "--configs", "fp32,w8a8-int,w8a8-fp8"])
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = _rows(out)
    assert rows["fp32"] == [pytest.approx(1.0), pytest.approx(1.0)]
    assert rows["w8a8-int"][0] > 0.99 and rows["w8a8-fp8"][0] > 0.99
