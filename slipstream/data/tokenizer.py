"""The toy tokenizers' one protocol (:class:`TextTokenizer`), and the byte-level tokenizer:
one token per UTF-8 byte, vocabulary of 256.

:class:`TextTokenizer` is what slipstream asks of a tokenizer that is not a Hugging Face one:
``encode``/``decode``, ``vocab_size``, and the pad and EOS ids (None where it has none). The
byte tokenizer here, the character tokenizer of ``slipstream chat`` (:class:`CharTokenizer`)
and the VisualChat demo's word tokenizer (``slipstream.multimodal.digits.WordTokenizer``)
implement it; ``slipstream.models.files`` saves and loads the first two with a model.

Why bytes: it needs no download (no vocabulary file, no hub), no training step (no BPE
merges to learn), and encoding round-trips exactly for every string. The cost is longer
sequences than a subword tokenizer (about 1 token per character for source code), which
is fine for the small reference models this library trains in tests and demos.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from slipstream.config._errors import ConfigError

__all__ = ["ByteTokenizer", "CharTokenizer", "TextTokenizer", "encode_corpus"]


@runtime_checkable
class TextTokenizer(Protocol):
    """A tokenizer slipstream can use in place of a Hugging Face one."""

    pad_token_id: int | None
    eos_token_id: int | None

    @property
    def vocab_size(self) -> int:
        """Number of distinct token ids."""
        ...

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """The ids of ``text`` (no special tokens are added)."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` (special ids dropped)."""
        ...


class ByteTokenizer:
    """Maps text to its UTF-8 bytes and back. Stateless; ids are in [0, 256)."""

    vocab_size: int = 256
    """Number of distinct token ids."""
    pad_token_id: int | None = None
    eos_token_id: int | None = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """UTF-8 bytes of ``text`` as a list of ints in [0, 256)."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """Inverse of :meth:`encode`; invalid UTF-8 (e.g. sampled byte soup) becomes U+FFFD.

        Raises:
            ValueError: an id is outside [0, 256).
        """
        try:
            return bytes(list(ids)).decode("utf-8", errors="replace")
        except ValueError as exc:
            raise ValueError(
                f"ByteTokenizer.decode got an id outside [0, 256): {exc}; ids must be bytes"
            ) from exc


class CharTokenizer:
    """One id per character (``slipstream chat``'s tokenizer of the reference GPT): pad 0,
    EOS 1, the characters from 2. Built from the data (:meth:`from_texts`)."""

    pad_token_id: int | None = 0
    eos_token_id: int | None = 1
    chat_template = None

    def __init__(self, chars: str) -> None:
        self.chars = chars
        self._ids = {c: i + 2 for i, c in enumerate(chars)}

    @classmethod
    def from_texts(cls, texts: Sequence[str]) -> CharTokenizer:
        return cls("".join(sorted(set("".join(texts)))))

    @property
    def vocab_size(self) -> int:
        return len(self.chars) + 2

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        try:
            return [self._ids[c] for c in text]
        except KeyError as e:
            raise ConfigError(
                f"character {e.args[0]!r} of {text[:40]!r} is not in this character "
                f"tokenizer's vocabulary ({self.chars!r}): the model was built from other data"
            ) from None

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.chars[i - 2] for i in ids if i >= 2)


def encode_corpus(text: str, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Encode ``text`` to a 1-D tensor of byte ids without a Python list in between.

    Args:
        text: the text to encode.
        dtype: result dtype; ``torch.long`` (default, 8 bytes/token) or ``torch.uint8``
            (1 byte/token, accepted by :class:`slipstream.data.TokenDataset`) for large text.

    Returns:
        Tensor of shape [len(text.encode("utf-8"))].
    """
    data = bytearray(text.encode("utf-8"))
    if not data:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(data, dtype=torch.uint8).to(dtype, copy=True)
