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

Saves are atomic: everything is written into a hidden temporary directory and fsynced; each
rank reports its files' sizes and CRC-32s; rank 0 writes the manifest (with a SHA-256 of its
own content, so an edited or damaged manifest is refused) and renames the directory into place;
``latest`` is replaced by rename as well (``commit`` has the steps and the crash recovery).
A crash at any point leaves the previous checkpoint and ``latest`` loadable.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import save_file

from slipstream.checkpoint import _faults

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "CheckpointReader",
    "LogicalReader",
    "Piece",
    "atomic_write_text",
    "file_digest",
    "fsync_dir",
    "read_manifest",
    "write_manifest",
    "write_pieces",
]

FORMAT_VERSION = 2
"""2: the manifest must carry its digest. 1: written before the digest was required (most
version-1 manifests have it and are checked; one without it loads unchecked)."""
_READABLE_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
MANIFEST_DIGEST = "manifest_sha256"
"""The manifest's key for the SHA-256 of the rest of it."""
_REQUIRED = ("tensors", "pieces", "files")

_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32)
}
_DTYPES.update({"uint8": torch.uint8, "bool": torch.bool, "int8": torch.int8})


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupted or does not fit the engine."""


class LogicalReader(Protocol):
    """What restoring reads a checkpoint through: logical tensors by name and ranges of them,
    the manifest (counters, optimizer hyperparameters and scalars), and ``extra.pt``'s objects.
    ``CheckpointReader`` reads slipstream's layout; ``from_deepspeed.DeepSpeedReader`` DeepSpeed's."""

    dir: Path
    manifest: dict[str, Any]

    def verify_share(self, rank: int, world: int) -> None: ...
    def trust_all(self) -> None: ...
    def load_object(self, name: str) -> Any: ...
    def has(self, tensor: str) -> bool: ...
    def names(self, kind: str) -> list[str]: ...
    def shape(self, tensor: str) -> tuple[int, ...]: ...
    def dtype(self, tensor: str) -> torch.dtype: ...
    def numel(self, tensor: str) -> int: ...
    def read(
        self,
        tensor: str,
        start: int = 0,
        stop: int | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor: ...
    def read_full(self, tensor: str) -> torch.Tensor: ...
    def close(self) -> None: ...


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


def file_digest(path: Path, chunk: int = 1 << 22) -> tuple[int, int]:
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
    _faults.point(f"wrote.{path.name}")
    return file_digest(path)


def write_object(path: Path, obj: Any) -> tuple[int, int]:
    """``torch.save`` durably; returns (size, crc)."""
    torch.save(obj, path)
    _fsync_file(path)
    _faults.point(f"wrote.{path.name}")
    return file_digest(path)


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _manifest_sha256(manifest: dict[str, Any]) -> str:
    """SHA-256 of the manifest without its digest, in a canonical form (sorted keys, compact)
    that reading the JSON back reproduces exactly."""
    body = {k: v for k, v in manifest.items() if k != MANIFEST_DIGEST}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def write_manifest(path: Path, manifest: dict[str, Any]) -> None:
    """Write ``manifest`` with its own SHA-256 durably (JSON round trip first, so the digest
    covers what a reader parses: int keys become strings, tuples lists)."""
    parsed = json.loads(json.dumps(manifest))
    parsed[MANIFEST_DIGEST] = _manifest_sha256(parsed)
    path.write_text(json.dumps(parsed, indent=1))
    _fsync_file(path)
    _faults.point("manifest.written")


def read_manifest(path: Path) -> dict[str, Any]:
    """Parse and check a manifest; every failure is a ``CheckpointError`` naming ``path``."""
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: {path.parent} is not a complete checkpoint")
    try:
        manifest = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(
            f"{path} is damaged (not valid UTF-8 JSON: {e}); refusing to load {path.parent}"
        ) from e
    if not isinstance(manifest, dict):
        raise CheckpointError(
            f"{path} is damaged: it holds a {type(manifest).__name__}, not an object"
        )
    version = manifest.get("format_version")
    if version not in _READABLE_VERSIONS:
        raise CheckpointError(
            f"{path} has format_version {version!r}; this slipstream reads versions "
            f"{', '.join(map(str, _READABLE_VERSIONS))}"
        )
    want = manifest.get(MANIFEST_DIGEST)
    if want is None and version != 1:
        raise CheckpointError(
            f"{path} was edited or damaged after it was written: it has no {MANIFEST_DIGEST}, "
            f"which every format_version {version} manifest carries; refusing to load {path.parent}"
        )
    if want is not None and want != _manifest_sha256(manifest):
        raise CheckpointError(
            f"{path} was edited or damaged after it was written (its content no longer matches "
            f"its {MANIFEST_DIGEST}); refusing to load {path.parent}"
        )
    missing = [k for k in _REQUIRED if k not in manifest]
    if missing:
        raise CheckpointError(f"{path} is damaged: it has no {missing}")
    return manifest


class TensorTable:
    """The table half of a ``LogicalReader``: ``tensors`` maps each logical tensor's name to
    its ``shape`` and ``dtype`` name; ``read`` checks the name and the range (``where`` names
    the checkpoint in the error) before ``_read_into`` fills the range. ``CheckpointReader``
    and ``from_deepspeed.DeepSpeedReader`` differ only in where the elements come from."""

    tensors: dict[str, dict[str, Any]]
    where: str

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
        return math.prod(self.shape(tensor))

    def read(
        self,
        tensor: str,
        start: int = 0,
        stop: int | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Elements ``[start, stop)`` of flattened ``tensor`` (into ``out``, cast, if given)."""
        if tensor not in self.tensors:
            raise CheckpointError(f"{self.where} holds no tensor '{tensor}'")
        numel = self.numel(tensor)
        stop = numel if stop is None else stop
        if not 0 <= start <= stop <= numel:
            raise CheckpointError(f"range [{start}, {stop}) outside '{tensor}' of {numel} elements")
        if out is None:
            out = torch.empty(stop - start, dtype=self.dtype(tensor))
        self._read_into(tensor, start, stop, out)
        return out

    def _read_into(self, tensor: str, start: int, stop: int, out: torch.Tensor) -> None:
        raise NotImplementedError

    def read_full(self, tensor: str) -> torch.Tensor:
        return self.read(tensor).reshape(self.shape(tensor))


class CheckpointReader(TensorTable):
    """Reads ranges of logical tensors from a committed checkpoint, verifying each file once.

    Every file is checked against the manifest's size and CRC-32 before its first read: a
    truncated or corrupted file is a ``CheckpointError`` naming it, never wrong values.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.dir = Path(directory)
        if not self.dir.is_dir():
            raise CheckpointError(f"checkpoint directory {self.dir} does not exist")
        self.manifest: dict[str, Any] = read_manifest(self.dir / MANIFEST)
        self.tensors = self.manifest["tensors"]
        self.where = f"checkpoint {self.dir}"
        self.pieces: dict[str, list[Piece]] = {}
        for entry in self.manifest["pieces"]:
            piece = Piece(*entry)
            self.pieces.setdefault(piece.tensor, []).append(piece)
        for plist in self.pieces.values():
            plist.sort(key=lambda p: p.start)
        self._verified: set[str] = set()
        self._handles: dict[str, _PieceFile] = {}

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

    def verify_share(self, rank: int, world: int) -> None:
        """Verify this rank's share of the files (``rank-XXXXX.*`` by rank ``X % world``, the
        others round robin), so a load checks each file once in all; then ``trust_all``."""
        others = 0
        for name in sorted(self.manifest["files"]):
            if name.startswith("rank-") and name[5:10].isdigit():
                owner = int(name[5:10]) % world
            else:
                owner, others = others % world, others + 1
            if owner == rank:
                self.verify(name)

    def trust_all(self) -> None:
        """Every rank verified its share without error: skip the checks on first read."""
        self._verified.update(self.manifest["files"])

    def load_object(self, name: str) -> Any:
        """A ``torch.save``d object of this checkpoint (trusted: written by slipstream)."""
        return torch.load(self.verify(name), map_location="cpu", weights_only=False)

    def _handle(self, name: str) -> _PieceFile:
        if name not in self._handles:
            self._handles[name] = _PieceFile(self.verify(name))
        return self._handles[name]

    # ---------------------------------------------------------------- tensors
    def _read_into(self, tensor: str, start: int, stop: int, out: torch.Tensor) -> None:
        covered = 0
        for piece in self.pieces.get(tensor, []):
            lo, hi = max(start, piece.start), min(stop, piece.stop)
            if lo >= hi:
                continue
            part = self._handle(piece.file).read(piece.key, lo - piece.start, hi - piece.start)
            out[lo - start : hi - start].copy_(part)
            covered += hi - lo
        if covered != stop - start:
            raise CheckpointError(
                f"checkpoint {self.dir} covers only {covered} of elements [{start}, {stop}) of "
                f"'{tensor}': pieces are missing (was a rank's file replaced?)"
            )

    def close(self) -> None:
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()


_ST_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


class _PieceFile:
    """Ranges of 1-D tensors in a safetensors file, read with ``pread`` (no memory map: a
    mapped file's touched pages stay resident, and a file replaced underneath a map crashes
    the process instead of raising)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        (length,) = struct.unpack("<Q", os.pread(self.fd, 8, 0))
        self.header: dict[str, Any] = json.loads(os.pread(self.fd, length, 8))
        self.data_start = 8 + length

    def read(self, key: str, start: int, stop: int) -> torch.Tensor:
        entry = self.header.get(key)
        if entry is None:
            raise CheckpointError(f"{self.path} has no tensor '{key}'")
        dtype = _ST_DTYPES[entry["dtype"]]
        size = torch.empty((), dtype=dtype).element_size()
        begin = self.data_start + entry["data_offsets"][0] + start * size
        raw = bytearray((stop - start) * size)
        if os.preadv(self.fd, [raw], begin) != len(raw):
            raise CheckpointError(f"{self.path}: tensor '{key}' is cut short")
        if not raw:
            return torch.empty(0, dtype=dtype)
        return torch.frombuffer(raw, dtype=dtype)

    def close(self) -> None:
        os.close(self.fd)


class StreamingSafetensorsWriter:
    """Write one safetensors file tensor by tensor: the header is computed from the shapes
    up front, so only one tensor needs to be in memory at a time."""

    def __init__(self, path: Path, layout: list[tuple[str, tuple[int, ...], torch.dtype]]):
        header: dict[str, Any] = {}
        offset = 0
        self.expected: list[tuple[str, int]] = []
        for name, shape, dtype in layout:
            n = 1
            for d in shape:
                n *= d
            nbytes = n * torch.empty((), dtype=dtype).element_size()
            header[name] = {
                "dtype": _ST_NAMES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            self.expected.append((name, nbytes))
            offset += nbytes
        header["__metadata__"] = {"format": "pt"}
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self.path = path
        self.f = open(path, "wb")  # noqa: SIM115 - closed in finish()
        self.f.write(struct.pack("<Q", len(blob)) + blob)
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        want, nbytes = self.expected[self._next]
        if name != want:
            raise ValueError(f"{self.path}: expected tensor '{want}' next, got '{name}'")
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        if data.nbytes != nbytes:
            raise ValueError(f"{self.path}: tensor '{name}' has {data.nbytes} bytes, not {nbytes}")
        self.f.write(data.data)
        self._next += 1

    def finish(self) -> None:
        if self._next != len(self.expected):
            raise ValueError(f"{self.path}: only {self._next} of {len(self.expected)} written")
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()


def tensor_table(entries: Iterable[tuple[str, tuple[int, ...], torch.dtype]]) -> dict[str, Any]:
    return {name: {"shape": list(shape), "dtype": dtype_name(dt)} for name, shape, dt in entries}
