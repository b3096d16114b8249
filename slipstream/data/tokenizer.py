"""Byte-level tokenizer: one token per UTF-8 byte, vocabulary of 256.

Why bytes: it needs no download (no vocabulary file, no hub), no training step (no BPE
merges to learn), and encoding round-trips exactly for every string. The cost is longer
sequences than a subword tokenizer (about 1 token per character for source code), which
is fine for the small reference models this library trains in tests and demos.
"""

from __future__ import annotations

import torch

__all__ = ["ByteTokenizer", "encode_corpus"]


class ByteTokenizer:
    """Maps text to its UTF-8 bytes and back. Stateless; ids are in [0, 256)."""

    vocab_size: int = 256
    """Number of distinct token ids."""

    def encode(self, text: str) -> list[int]:
        """UTF-8 bytes of ``text`` as a list of ints in [0, 256)."""
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """Inverse of :meth:`encode`; invalid UTF-8 (e.g. sampled byte soup) becomes U+FFFD.

        Raises:
            ValueError: an id is outside [0, 256).
        """
        try:
            return bytes(ids).decode("utf-8", errors="replace")
        except ValueError as exc:
            raise ValueError(
                f"ByteTokenizer.decode got an id outside [0, 256): {exc}; ids must be bytes"
            ) from exc


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
