"""On-disk layout of a slipstream checkpoint: per-rank safetensors pieces plus a manifest.

A checkpoint is a directory ``<save_dir>/<tag>/``::

    manifest.json              what every logical tensor is (shape, dtype) and where its pieces
                               are; engine counters; optimizer hyperparameters; per-file size
                               and CRC-32; written last, by rank 0
    rank-00000.safetensors     the pieces rank 0 owns (1-D slices of flattened tensors)
    rank-00000.pt              rank 0's RNG states and data-loader position
    extra.pt                   client_state and the LR scheduler state (rank 0)

A *logical tensor* is named ``<kind>/<parameter name>``: ``model/...`` (parameters in their
training dtype), ``master/...`` (fp32 master weights when they are separate), ``optim/<state
key>/...`` (optimizer states), ``buffer/...`` (persistent buffers). Each is stored flattened, as
pieces ``[start, stop)`` that together cover it exactly once, so any rank of any later world
size can read any range of it without knowing how the writer was sharded (resharding needs no
conversion step). Safetensors files are read lazily: a range costs only its bytes.

Saves are atomic: everything is written into a hidden temporary directory, fsynced, verified
by rank 0 and renamed into place; ``latest`` is replaced by rename as well. A crash at any point
leaves the previous checkpoint and ``latest`` as they were.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "CheckpointReader",
    "Piece",
    "atomic_write_text",
    "commit_dir",
    "file_digest",
    "fsync_dir",
    "write_pieces",
]

FORMAT_VERSION = 1
MANIFEST = "manifest.json"

_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32)
}
_DTYPES.update({"uint8": torch.uint8, "bool": torch.bool, "int8": torch.int8})


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupted or does not fit the engine."""


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, stop)`` of flattened logical tensor ``tensor``, stored in ``file``."""

    tensor: str
    start: int
    stop: int
    file: str
    key: str


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    return _DTYPES[name]


def file_digest(path: Path, chunk: int = 1 << 24) -> tuple[int, int]:
    """(size in bytes, CRC-32) of ``path``, read in chunks."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
            size += len(block)
    return size, crc


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def write_pieces(path: Path, tensors: dict[str, torch.Tensor]) -> tuple[int, int]:
    """Write ``tensors`` (1-D pieces) to one safetensors file durably; returns (size, crc)."""
    save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(path))
    _fsync_file(path)
    return file_digest(path)


def write_object(path: Path, obj: Any) -> tuple[int, int]:
    """``torch.save`` durably; returns (size, crc)."""
    torch.save(obj, path)
    _fsync_file(path)
    return file_digest(path)


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def commit_dir(tmp: Path, final: Path) -> None:
    """Move a fully written checkpoint directory into place (replacing an older one)."""
    fsync_dir(tmp)
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


class CheckpointReader:
    """Reads ranges of logical tensors from a committed checkpoint, verifying each file once.

    Every file is checked against the manifest's size and CRC-32 before its first read: a
    truncated or corrupted file is a ``CheckpointError`` naming it, never wrong values.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.dir = Path(directory)
        path = self.dir / MANIFEST
        if not path.is_file():
            raise CheckpointError(
                f"{self.dir} is not a complete slipstream checkpoint: {MANIFEST} is missing "
                "(an interrupted save leaves no tag directory, so this is not one of ours or "
                "it was damaged)"
            )
        try:
            self.manifest: dict[str, Any] = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path} is not valid JSON ({e}): the file is corrupted") from e
        version = self.manifest.get("format_version")
        if version != FORMAT_VERSION:
            raise CheckpointError(
                f"{path} has format_version {version!r}; this slipstream reads version "
                f"{FORMAT_VERSION}"
            )
        self.tensors: dict[str, dict[str, Any]] = self.manifest["tensors"]
        self.pieces: dict[str, list[Piece]] = {}
        for entry in self.manifest["pieces"]:
            piece = Piece(*entry)
            self.pieces.setdefault(piece.tensor, []).append(piece)
        for plist in self.pieces.values():
            plist.sort(key=lambda p: p.start)
        self._verified: set[str] = set()
        self._handles: dict[str, Any] = {}

    # ------------------------------------------------------------------ files
    def verify(self, name: str) -> Path:
        path = self.dir / name
        if name in self._verified:
            return path
        files: dict[str, list[int]] = self.manifest["files"]
        if name not in files:
            raise CheckpointError(f"{path} is not listed in {self.dir / MANIFEST}")
        want_size, want_crc = files[name]
        if not path.is_file():
            raise CheckpointError(f"checkpoint file {path} is missing")
        size, crc = file_digest(path)
        if size != want_size:
            raise CheckpointError(
                f"checkpoint file {path} has {size} bytes, the manifest says {want_size}: it was "
                "truncated or overwritten"
            )
        if crc != want_crc:
            raise CheckpointError(
                f"checkpoint file {path} is corrupted (CRC-32 {crc:#010x}, manifest "
                f"{want_crc:#010x}); refusing to load it"
            )
        self._verified.add(name)
        return path

    def load_object(self, name: str) -> Any:
        """A ``torch.save``d object of this checkpoint (trusted: written by slipstream)."""
        return torch.load(self.verify(name), map_location="cpu", weights_only=False)

    def _handle(self, name: str) -> Any:
        if name not in self._handles:
            self._handles[name] = safe_open(str(self.verify(name)), framework="pt")
        return self._handles[name]

    # ---------------------------------------------------------------- tensors
    def has(self, tensor: str) -> bool:
        return tensor in self.tensors

    def names(self, kind: str) -> list[str]:
        prefix = kind + "/"
        return [t.removeprefix(prefix) for t in self.tensors if t.startswith(prefix)]

    def shape(self, tensor: str) -> tuple[int, ...]:
        return tuple(self.tensors[tensor]["shape"])

    def dtype(self, tensor: str) -> torch.dtype:
        return dtype_from_name(self.tensors[tensor]["dtype"])

    def numel(self, tensor: str) -> int:
        n = 1
        for d in self.shape(tensor):
            n *= d
        return n

    def read(
        self,
        tensor: str,
        start: int = 0,
        stop: int | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Elements ``[start, stop)`` of flattened ``tensor`` (into ``out``, cast, if given)."""
        if tensor not in self.tensors:
            raise CheckpointError(f"{self.dir} holds no tensor '{tensor}'")
        numel = self.numel(tensor)
        stop = numel if stop is None else stop
        if not 0 <= start <= stop <= numel:
            raise CheckpointError(f"range [{start}, {stop}) outside '{tensor}' of {numel} elements")
        if out is None:
            out = torch.empty(stop - start, dtype=self.dtype(tensor))
        covered = 0
        for piece in self.pieces.get(tensor, []):
            lo, hi = max(start, piece.start), min(stop, piece.stop)
            if lo >= hi:
                continue
            part = self._handle(piece.file).get_slice(piece.key)[
                lo - piece.start : hi - piece.start
            ]
            out[lo - start : hi - start].copy_(part)
            covered += hi - lo
        if covered != stop - start:
            raise CheckpointError(
                f"checkpoint {self.dir} covers only {covered} of elements [{start}, {stop}) of "
                f"'{tensor}': pieces are missing (was a rank's file replaced?)"
            )
        return out

    def read_full(self, tensor: str) -> torch.Tensor:
        return self.read(tensor).reshape(self.shape(tensor))

    def close(self) -> None:
        self._handles.clear()


def tensor_table(entries: Iterable[tuple[str, tuple[int, ...], torch.dtype]]) -> dict[str, Any]:
    return {name: {"shape": list(shape), "dtype": dtype_name(dt)} for name, shape, dt in entries}
