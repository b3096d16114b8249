"""An embedded training corpus: the Python standard library's own source code.

Every Python installation ships these files, so the demo, tests and benchmarks need no
download. The text is a fixed, sorted list of pure-Python modules present in CPython
3.10-3.13, concatenated with a one-line header per file; about 3.3-3.5 MB depending on
the Python version (deterministic for a given installation).
"""

from __future__ import annotations

import functools
import sysconfig
from pathlib import Path

import torch
from torch.utils.data import Dataset

__all__ = ["CORPUS_MODULES", "TokenDataset", "load_corpus", "split_train_val"]

CORPUS_MODULES: tuple[str, ...] = (
    "_pydecimal.py", "_pyio.py", "argparse.py", "ast.py", "base64.py", "bdb.py",
    "calendar.py", "cmd.py", "codecs.py", "configparser.py", "contextlib.py", "copy.py",
    "csv.py", "dataclasses.py", "datetime.py", "difflib.py", "dis.py", "doctest.py",
    "enum.py", "fileinput.py", "fractions.py", "ftplib.py", "functools.py", "gettext.py",
    "gzip.py", "heapq.py", "hmac.py", "imaplib.py", "inspect.py", "ipaddress.py",
    "linecache.py", "locale.py", "mailbox.py", "mimetypes.py", "operator.py", "optparse.py",
    "os.py", "pdb.py", "pickle.py", "pickletools.py", "platform.py", "plistlib.py",
    "poplib.py", "pprint.py", "profile.py", "pstats.py", "pydoc.py", "queue.py",
    "random.py", "selectors.py", "shlex.py", "shutil.py", "smtplib.py", "socket.py",
    "socketserver.py", "ssl.py", "statistics.py", "string.py", "subprocess.py", "tarfile.py",
    "tempfile.py", "textwrap.py", "threading.py", "timeit.py", "tokenize.py", "trace.py",
    "traceback.py", "typing.py", "uuid.py", "warnings.py", "wave.py", "weakref.py",
    "webbrowser.py",
)  # fmt: skip
"""Standard-library files making up the corpus, in order (sorted; missing ones are skipped)."""


@functools.lru_cache(maxsize=1)
def _full_corpus() -> str:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts = []
    for name in CORPUS_MODULES:
        path = stdlib / name
        if path.is_file():
            text = path.read_bytes().decode("utf-8", errors="replace")
            parts.append(f"# ===== {name} =====\n{text}\n")
    if not parts:
        raise RuntimeError(
            f"no corpus files found under the stdlib directory {stdlib}; this Python "
            "installation has no plain-source standard library (e.g. a zipped stdlib), "
            "so supply your own text instead of load_corpus()"
        )
    return "".join(parts)


def load_corpus(max_bytes: int | None = None) -> str:
    """Return the embedded corpus text (deterministic for a given Python installation).

    Args:
        max_bytes: if given, keep at most this many UTF-8 bytes from the start (a
            multi-byte character cut at the boundary is dropped).

    Returns:
        The text, about 3.3-3.5 MB in full; cached after the first call.

    Raises:
        ValueError: ``max_bytes`` is negative.
        RuntimeError: no corpus file exists in this installation's stdlib directory.
    """
    text = _full_corpus()
    if max_bytes is None:
        return text
    if max_bytes < 0:
        raise ValueError(f"load_corpus max_bytes={max_bytes} must be >= 0 or None (full corpus)")
    if max_bytes >= len(text.encode("utf-8")):
        return text
    return text.encode("utf-8")[:max_bytes].decode("utf-8", errors="ignore")


def split_train_val(tokens: torch.Tensor, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a 1-D token tensor into (train, val): the last ``val_fraction`` is validation.

    A contiguous tail split (not shuffled) so the result is deterministic and validation
    text never overlaps training text. Returns views, no copy.

    Raises:
        ValueError: ``tokens`` is not 1-D, or ``val_fraction`` is outside (0, 1).
    """
    if tokens.dim() != 1:
        raise ValueError(f"split_train_val expects a 1-D tensor, got shape {tuple(tokens.shape)}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(
            f"split_train_val val_fraction={val_fraction} must be in (0, 1), e.g. 0.05"
        )
    n_val = max(1, int(len(tokens) * val_fraction))
    return tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val :]


class TokenDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Non-overlapping blocks of ``seq_len`` tokens for next-token prediction.

    Item ``i`` is ``(input_ids, labels)``, both int64 [seq_len], with
    ``labels[t] == tokens[i * seq_len + t + 1]`` (already shifted, as ``GPT.forward``
    expects). The source tensor may be any integer dtype (uint8 keeps a byte corpus at
    1 byte per token); items are converted to int64 one at a time.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        if tokens.dim() != 1 or tokens.is_floating_point():
            raise ValueError(
                f"TokenDataset expects a 1-D integer tensor, got shape {tuple(tokens.shape)} "
                f"dtype {tokens.dtype}"
            )
        if seq_len < 1:
            raise ValueError(f"TokenDataset seq_len={seq_len} must be >= 1")
        if len(tokens) < seq_len + 1:
            raise ValueError(
                f"TokenDataset needs at least seq_len + 1 = {seq_len + 1} tokens, got "
                f"{len(tokens)}; use a shorter seq_len or more text"
            )
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        # The last token of each block is the label of the block's final position.
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"TokenDataset index {index} out of range for length {len(self)}")
        index %= len(self)
        start = index * self.seq_len
        # Copies: editing an item (e.g. masking labels with -100) must not touch the corpus
        # or the other tensor of the pair.
        block = self.tokens[start : start + self.seq_len + 1].to(torch.long, copy=True)
        return block[:-1], block[1:].clone()
