"""Data with no download: an embedded corpus, a byte-level tokenizer and a block dataset."""

from slipstream.data.corpus import CORPUS_MODULES, TokenDataset, load_corpus, split_train_val
from slipstream.data.tokenizer import ByteTokenizer, CharTokenizer, TextTokenizer, encode_corpus

__all__ = [
    "CORPUS_MODULES",
    "ByteTokenizer",
    "CharTokenizer",
    "TextTokenizer",
    "TokenDataset",
    "encode_corpus",
    "load_corpus",
    "split_train_val",
]
