"""Models on disk (slipstream.models.files): the GPT format round-trips, the earlier layout of
``slipstream chat`` is still read, and the toy tokenizers share one protocol."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch

from slipstream.config import ConfigError
from slipstream.data.tokenizer import ByteTokenizer, CharTokenizer, TextTokenizer
from slipstream.models import GPT, GPTConfig, files


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=40, hidden_size=32, num_layers=2, num_heads=4, max_seq_len=16,
                         tie_embeddings=True))  # fmt: skip


def test_gpt_round_trips_with_its_tokenizer(tmp_path):
    model, tok = _gpt(), CharTokenizer("abc ")
    files.save_gpt(model.config, model.state_dict(), tmp_path, tok)
    assert files.is_gpt_dir(tmp_path)
    loaded = files.load_gpt(tmp_path)
    assert loaded.config == model.config
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    back = files.load_tokenizer(tmp_path)
    assert isinstance(back, CharTokenizer) and back.encode("cab") == tok.encode("cab")


def test_the_earlier_chat_layout_is_still_read(tmp_path):
    model = _gpt()
    meta = {"config": asdict(model.config), "reward": False}
    (tmp_path / files.LEGACY_GPT_FILE).write_text(json.dumps(meta))
    torch.save(model.state_dict(), tmp_path / "model.pt")
    assert files.is_gpt_dir(tmp_path)
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(files.load_gpt(tmp_path)(ids), model(ids))
    assert isinstance(files.load_tokenizer(tmp_path), ByteTokenizer)  # none saved: bytes
    meta["reward"] = True
    (tmp_path / files.LEGACY_GPT_FILE).write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match="reward model"):
        files.load_gpt(tmp_path)


def test_a_directory_that_is_no_gpt_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"no gpt_config\.json"):
        files.load_gpt_config(tmp_path)


def test_byte_char_and_word_tokenizers_implement_one_protocol():
    from slipstream.multimodal.digits import WordTokenizer

    for tok in (ByteTokenizer(), CharTokenizer("xyz"), WordTokenizer()):
        assert isinstance(tok, TextTokenizer)
        ids = tok.encode("image") if isinstance(tok, WordTokenizer) else tok.encode("xy")
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) in ("image", "xy")
    assert (CharTokenizer("a").pad_token_id, CharTokenizer("a").eos_token_id) == (0, 1)
    assert (WordTokenizer().pad_token_id, WordTokenizer().eos_token_id) == (0, 1)
