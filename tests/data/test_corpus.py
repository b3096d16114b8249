"""Tests for the embedded corpus, byte tokenizer and token dataset (slipstream/data)."""

from __future__ import annotations

import pytest
import torch

from slipstream.data import (
    CORPUS_MODULES,
    ByteTokenizer,
    TokenDataset,
    encode_corpus,
    load_corpus,
    split_train_val,
)


def test_corpus_size_and_determinism() -> None:
    """The full corpus is 2-4 MB of stdlib source and identical across calls."""
    text = load_corpus()
    assert 2_000_000 <= len(text.encode("utf-8")) <= 4_000_000
    assert text == load_corpus()
    assert "# ===== argparse.py =====" in text
    assert list(CORPUS_MODULES) == sorted(CORPUS_MODULES)


def test_corpus_max_bytes_truncates_a_prefix() -> None:
    """max_bytes keeps a prefix of at most that many UTF-8 bytes."""
    full = load_corpus()
    head = load_corpus(max_bytes=10_000)
    assert full.startswith(head) and 9_996 <= len(head.encode("utf-8")) <= 10_000
    assert load_corpus(max_bytes=0) == ""
    with pytest.raises(ValueError, match="max_bytes=-1 must be >= 0"):
        load_corpus(max_bytes=-1)


def test_tokenizer_round_trip() -> None:
    """encode/decode round-trips any text exactly, including non-ASCII."""
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'héllo ✓ 🐍'\n"
    ids = tok.encode(text)
    assert tok.vocab_size == 256 and all(0 <= i < 256 for i in ids)
    assert len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_tokenizer_decode_replaces_invalid_utf8() -> None:
    """Invalid byte sequences decode to U+FFFD rather than raising; ids >= 256 raise."""
    tok = ByteTokenizer()
    assert tok.decode([0x61, 0xFF, 0x62]) == "a\ufffdb"
    with pytest.raises(ValueError, match="outside \\[0, 256\\)"):
        tok.decode([300])


def test_encode_corpus_matches_tokenizer() -> None:
    """encode_corpus gives the tokenizer's ids as int64 (or uint8 when asked)."""
    text = load_corpus(max_bytes=5_000)
    ids = encode_corpus(text)
    assert ids.dtype == torch.long and ids.tolist() == ByteTokenizer().encode(text)
    small = encode_corpus(text, dtype=torch.uint8)
    assert small.dtype == torch.uint8 and torch.equal(small.long(), ids)
    assert encode_corpus("").shape == (0,)


def test_dataset_shapes_and_label_shift() -> None:
    """Items are non-overlapping seq_len blocks with labels shifted by one token."""
    tokens = torch.arange(100, dtype=torch.uint8)
    ds = TokenDataset(tokens, seq_len=16)
    assert len(ds) == 6  # (100 - 1) // 16
    x, y = ds[1]
    assert x.dtype == y.dtype == torch.long and x.shape == y.shape == (16,)
    assert x.tolist() == list(range(16, 32)) and y.tolist() == list(range(17, 33))
    assert torch.equal(ds[-1][0], ds[5][0])
    with pytest.raises(IndexError):
        ds[6]


def test_dataset_items_are_copies() -> None:
    """Editing an item's labels touches neither its inputs nor the token tensor."""
    tokens = torch.arange(40)
    x, y = TokenDataset(tokens, seq_len=8)[0]
    y[:] = -100
    assert x.tolist() == list(range(8)) and tokens[1] == 1


def test_dataset_rejects_bad_input() -> None:
    """Too few tokens, bad seq_len or non-integer tokens raise with the constraint."""
    with pytest.raises(ValueError, match="needs at least seq_len \\+ 1 = 17 tokens, got 16"):
        TokenDataset(torch.arange(16), seq_len=16)
    with pytest.raises(ValueError, match="seq_len=0 must be >= 1"):
        TokenDataset(torch.arange(16), seq_len=0)
    with pytest.raises(ValueError, match="1-D integer tensor"):
        TokenDataset(torch.zeros(16), seq_len=4)


def test_split_train_val_is_a_deterministic_tail_split() -> None:
    """The last val_fraction of tokens is validation; the split covers everything once."""
    tokens = torch.arange(1000)
    train, val = split_train_val(tokens, 0.1)
    assert len(train) == 900 and len(val) == 100
    assert torch.equal(torch.cat([train, val]), tokens)
    with pytest.raises(ValueError, match=r"val_fraction=1.0 must be in \(0, 1\)"):
        split_train_val(tokens, 1.0)


def test_corpus_pipeline_end_to_end() -> None:
    """Corpus -> uint8 tokens -> split -> dataset yields valid batches for a 64-token model."""
    tokens = encode_corpus(load_corpus(), dtype=torch.uint8)
    train, val = split_train_val(tokens, 0.05)
    ds = TokenDataset(train, seq_len=64)
    assert len(ds) > 40_000 and len(TokenDataset(val, seq_len=64)) > 1_000
    x, y = next(iter(torch.utils.data.DataLoader(ds, batch_size=4)))
    assert x.shape == y.shape == (4, 64) and int(x.max()) < 256
