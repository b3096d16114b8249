"""NVMe (file) offload of optimizer states and fp32 master weights (ZeRO-Infinity, Rajbhandari
et al. 2021, section 5).

Each ZeRO bucket's optimizer state (and its fp32 master copy when that is not the parameter
storage itself) lives in one file under ``nvme_path/rank{r}/``. The optimizer step swaps one
bucket in, updates it, and swaps it out, so host memory holds at most one bucket of state
instead of all of them. Writes go to a temporary file, are fsynced and renamed (a crash never
leaves a half-written file under the real name); each file's size and CRC-32 are kept and
checked on every read, so a truncated or corrupted swap file is an error naming the file.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["StateSwap", "SwapError", "TensorSwapper"]


class SwapError(RuntimeError):
    """A swap file is missing, truncated or corrupted."""


@dataclass(frozen=True)
class _Entry:
    layout: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]
    nbytes: int
    crc: int


class TensorSwapper:
    """Stores named groups of CPU tensors in files and reads them back verified."""

    def __init__(self, directory: str | os.PathLike[str], rank: int) -> None:
        self.dir = Path(directory) / f"rank{rank}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self._entries: dict[str, _Entry] = {}

    def path(self, key: str) -> Path:
        return self.dir / f"{key}.swap"

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def write(self, key: str, tensors: dict[str, torch.Tensor]) -> None:
        """Write ``tensors`` durably under ``key`` (replacing the previous version atomically)."""
        layout = []
        blobs = []
        for name, t in tensors.items():
            t = t.detach().to("cpu").contiguous()
            layout.append((name, t.dtype, tuple(t.shape)))
            blobs.append(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        data = b"".join(blobs)
        tmp = self.path(key).with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path(key))
        self._entries[key] = _Entry(tuple(layout), len(data), zlib.crc32(data))

    def read(self, key: str) -> dict[str, torch.Tensor]:
        """Read back what ``write`` stored under ``key``; verify size and checksum."""
        entry = self._entries[key]
        path = self.path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise SwapError(
                f"swap file {path} is missing (was nvme_path cleaned while training?)"
            ) from None
        if len(data) != entry.nbytes:
            raise SwapError(
                f"swap file {path} holds {len(data)} bytes, expected {entry.nbytes}: it was "
                "truncated or overwritten; the optimizer state cannot be recovered from it"
            )
        if zlib.crc32(data) != entry.crc:
            raise SwapError(
                f"swap file {path} is corrupted (CRC-32 mismatch); the optimizer state cannot be trusted"
            )
        out: dict[str, torch.Tensor] = {}
        offset = 0
        buf = bytearray(data)
        for name, dtype, shape in entry.layout:
            numel = 1
            for d in shape:
                numel *= d
            size = numel * torch.empty((), dtype=dtype).element_size()
            raw = (
                torch.frombuffer(buf, dtype=torch.uint8, count=size, offset=offset)
                if size
                else torch.empty(0, dtype=torch.uint8)
            )
            out[name] = raw.view(dtype).reshape(shape).clone()
            offset += size
        return out

    def bytes_on_disk(self) -> int:
        return sum(e.nbytes for e in self._entries.values())


class StateSwap:
    """Keeps each bucket's optimizer states (and its separate master, when it has one) in
    files between uses: the optimizer swaps one bucket in, updates it and swaps it out.

    Tensor states go to the files; scalar ones (Adam's ``step`` when it is a number) stay in
    memory, keyed by bucket, view index and name.
    """

    def __init__(self, directory: str | os.PathLike[str], rank: int) -> None:
        self.files = TensorSwapper(directory, rank)
        self._small: dict[tuple[int, int, str], Any] = {}

    def load(
        self, b: int, state: MutableMapping[Any, Any], views: list[torch.Tensor]
    ) -> torch.Tensor | None:
        """Put bucket ``b``'s states back into ``state`` (the inner optimizer's, keyed by
        ``views``); returns the master written out by :meth:`save`, if any."""
        master = self.files.read(f"m{b}")["master"] if f"m{b}" in self.files else None
        if f"s{b}" in self.files:
            states = self.files.read(f"s{b}")
            for i, view in enumerate(views):
                entry = {
                    k.split(".", 1)[1]: v for k, v in states.items() if k.split(".", 1)[0] == str(i)
                }
                entry.update({k: v for (bb, ii, k), v in self._small.items() if (bb, ii) == (b, i)})
                state[view] = entry
        return master

    def save(
        self,
        b: int,
        state: MutableMapping[Any, Any],
        views: list[torch.Tensor],
        master: torch.Tensor | None,
    ) -> None:
        """Write bucket ``b``'s states (taking them out of ``state``) and ``master`` (when it
        is separate from the parameters) to files; the caller frees the master."""
        tensors = {}
        for i, view in enumerate(views):
            for k, v in state.pop(view, {}).items():
                if isinstance(v, torch.Tensor):
                    tensors[f"{i}.{k}"] = v
                else:
                    self._small[(b, i, k)] = v
        if tensors:
            self.files.write(f"s{b}", tensors)
        if master is not None:
            self.files.write(f"m{b}", {"master": master})
