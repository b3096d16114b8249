"""Tensor-parallel checkpoints read at any TP degree (``tensor_parallel.autotp_size``).

A TP-sharded parameter is saved as one tensor per TP rank, ``<name>.tp<rank>of<size>``, with
its optimizer states and fp32 master under the same names; the manifest's ``tp_layout``
records, per parameter name, the split dimension, the number of fused blocks (q|k|v) and the
TP size. :class:`TPLayoutReader` wraps a checkpoint reader and presents those tensors in the
layout of the engine that loads them: a tensor saved at another TP degree (or unsplit) is
reassembled from its saved slices (:func:`~slipstream.parallel.tensor.tp_join`, fused blocks
in block order) and re-cut for this rank (:func:`~slipstream.parallel.tensor.tp_slice`).
Restoring then reads ranges of it as of any other tensor, so ZeRO stage, data-parallel size
and TP degree may all change at once. Each rank builds a full tensor only while it reads
that tensor's ranges (a small cache of recent ones), one parameter at a time.
"""

from __future__ import annotations

import math
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from slipstream.checkpoint.format import CheckpointError, LogicalReader
from slipstream.distributed.placement import TPShard, tp_shard
from slipstream.parallel.tensor.params import tp_join, tp_slice

__all__ = ["TPLayoutReader", "split_tp_name", "tp_layout_entry", "tp_view"]

_TP_SUFFIX = re.compile(r"^(.*)\.tp(\d+)of(\d+)$")
_CACHED = 4


def split_tp_name(name: str) -> tuple[str, int, int] | None:
    """``"w.tp1of2"`` -> ``("w", 1, 2)``; None for a name without a TP suffix."""
    m = _TP_SUFFIX.match(name)
    return None if m is None else (m.group(1), int(m.group(2)), int(m.group(3)))


def tp_layout_entry(p: torch.Tensor) -> list[int] | None:
    """What the manifest records of a TP-sharded parameter: ``[dim, parts, size]``."""
    shard = tp_shard(p)
    return None if shard is None else [shard.dim, shard.parts, shard.size]


def _split(tensor: str) -> tuple[str, str]:
    """``"optim/exp_avg/w"`` -> ``("optim/exp_avg", "w")``; ``"model/w"`` -> ``("model", "w")``."""
    kind, _, name = tensor.partition("/")
    if kind == "optim":
        key, _, name = name.partition("/")
        kind = f"optim/{key}"
    return kind, name


class TPLayoutReader:
    """A ``LogicalReader`` presenting a checkpoint's TP-sharded tensors in another layout.

    ``want`` maps a parameter name to the slice this rank holds (``TPShard``) or None for
    the full tensor; a name it does not list is presented in full (an export). Tensors the
    checkpoint holds under the wanted name are read through unchanged.
    """

    def __init__(self, inner: LogicalReader, want: dict[str, TPShard | None]) -> None:
        self.inner = inner
        self.want = want
        self.dir: Path = inner.dir
        self.manifest: dict[str, Any] = inner.manifest
        self.layout: dict[str, list[int]] = {
            k: list(v) for k, v in inner.manifest.get("tp_layout", {}).items()
        }
        # Sliced parameters without a layout record (checkpoints from before it existed).
        self._unrecorded = {
            parts[0]
            for n in inner.names("model")
            if (parts := split_tp_name(n)) is not None and parts[0] not in self.layout
        }
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()

    def verify_share(self, rank: int, world: int) -> None:
        self.inner.verify_share(rank, world)

    def trust_all(self) -> None:
        self.inner.trust_all()

    def load_object(self, name: str) -> Any:
        return self.inner.load_object(name)

    def close(self) -> None:
        self._cache.clear()
        self.inner.close()

    # -- where a wanted tensor comes from ---------------------------------------------------
    def _target(self, name: str) -> tuple[str, TPShard | None]:
        """The parameter a (possibly suffixed) name belongs to and the slice it asks for."""
        parts = split_tp_name(name)
        if parts is None:
            return name, None
        base = parts[0]
        shard = self.want.get(base)
        if shard is None or (shard.rank, shard.size) != parts[1:]:
            raise CheckpointError(f"tensor '{name}' is not a slice this rank holds")
        return base, shard

    def _saved(self, kind: str, base: str) -> tuple[list[str], int, int] | None:
        """The checkpoint tensors holding ``kind/base`` (one full tensor, or one per saved TP
        rank), with the saved split dimension and fused blocks; None if it has none."""
        if self.inner.has(f"{kind}/{base}"):
            return [f"{kind}/{base}"], 0, 1
        entry = self.layout.get(base)
        if entry is None:
            if base in self._unrecorded:
                raise CheckpointError(
                    f"checkpoint {self.inner.dir} holds TP slices of '{base}' but no record of "
                    "how they were split (saved by an older slipstream): load it at the "
                    "tensor_parallel.autotp_size it was saved with"
                )
            return None
        dim, parts, size = entry
        names = [f"{kind}/{base}.tp{r}of{size}" for r in range(size)]
        if not all(self.inner.has(n) for n in names):
            return None
        return names, dim, parts

    def _plan(self, tensor: str) -> tuple[list[str], int, int, TPShard | None] | None:
        kind, name = _split(tensor)
        try:
            base, shard = self._target(name)
        except CheckpointError:
            return None
        saved = self._saved(kind, base)
        if saved is None:
            return None
        sources, dim, parts = saved
        if shard is not None and len(sources) > 1 and (shard.dim, shard.parts) != (dim, parts):
            raise CheckpointError(
                f"checkpoint {self.inner.dir} split '{base}' along dim {dim} in {parts} block(s)"
                f", this model along dim {shard.dim} in {shard.parts}: the tensor-parallel "
                "plans differ; load with the plan the checkpoint was saved with"
            )
        return sources, dim, parts, shard

    # -- the LogicalReader surface ----------------------------------------------------------
    def has(self, tensor: str) -> bool:
        return self.inner.has(tensor) or self._plan(tensor) is not None

    def names(self, kind: str) -> list[str]:
        out: dict[str, None] = {}  # ordered, unique
        for entry in self.inner.names(kind):
            head, _, name = entry.rpartition("/")  # names("optim") are "<key>/<name>"
            parts = split_tp_name(name)
            base = name if parts is None else parts[0]
            if parts is not None and base not in self.layout:
                shard = self.want.get(base)
                if base in self.want and (shard is None or shard.size != parts[2]):
                    raise CheckpointError(
                        f"checkpoint {self.inner.dir} holds TP slices of '{base}' (TP size "
                        f"{parts[2]}) but no record of how they were split (saved by an older "
                        f"slipstream): load it at tensor_parallel.autotp_size {parts[2]}"
                    )
                out[entry] = None  # the same TP size: read as saved
                continue
            shard = self.want.get(base)
            new = base if shard is None else f"{base}.tp{shard.rank}of{shard.size}"
            out[f"{head}/{new}" if head else new] = None
        return list(out)

    def shape(self, tensor: str) -> tuple[int, ...]:
        if self.inner.has(tensor):
            return self.inner.shape(tensor)
        sources, dim, _, shard = self._need(tensor)
        full = list(self.inner.shape(sources[0]))
        full[dim] *= len(sources)
        if shard is not None:
            if full[shard.dim] % (shard.size * shard.parts):
                raise CheckpointError(
                    f"'{tensor}': dimension {shard.dim} of the saved tensor ({full[shard.dim]})"
                    f" does not split into {shard.size} ranks x {shard.parts} block(s)"
                )
            full[shard.dim] //= shard.size
        return tuple(full)

    def dtype(self, tensor: str) -> torch.dtype:
        if self.inner.has(tensor):
            return self.inner.dtype(tensor)
        return self.inner.dtype(self._need(tensor)[0][0])

    def numel(self, tensor: str) -> int:
        return math.prod(self.shape(tensor))

    def read(
        self,
        tensor: str,
        start: int = 0,
        stop: int | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.inner.has(tensor):
            return self.inner.read(tensor, start, stop, out)
        flat = self._value(tensor)
        stop = flat.numel() if stop is None else stop
        if not 0 <= start <= stop <= flat.numel():
            raise CheckpointError(
                f"range [{start}, {stop}) outside '{tensor}' of {flat.numel()} elements"
            )
        if out is None:
            return flat[start:stop].clone()
        out.copy_(flat[start:stop])
        return out

    def read_full(self, tensor: str) -> torch.Tensor:
        return self.read(tensor).reshape(self.shape(tensor))

    def _need(self, tensor: str) -> tuple[list[str], int, int, TPShard | None]:
        plan = self._plan(tensor)
        if plan is None:
            raise CheckpointError(f"checkpoint {self.inner.dir} holds no tensor '{tensor}'")
        return plan

    def _value(self, tensor: str) -> torch.Tensor:
        """The flattened tensor in the wanted layout (cached: restoring reads several ranges
        of each, the value and the master, the held and the owned part)."""
        hit = self._cache.get(tensor)
        if hit is not None:
            self._cache.move_to_end(tensor)
            return hit
        sources, dim, parts, shard = self._need(tensor)
        slices = [self.inner.read_full(s) for s in sources]
        full = slices[0] if len(slices) == 1 else tp_join(slices, dim, parts)
        value = full if shard is None else tp_slice(full, shard)
        flat = value.reshape(-1)
        self._cache[tensor] = flat
        while len(self._cache) > _CACHED:
            self._cache.popitem(last=False)
        return flat


def tp_view(reader: LogicalReader, module: nn.Module | None) -> LogicalReader:
    """``reader`` as ``module`` (its TP slices on this rank) needs it; ``module`` None: every
    tensor in full (export). Unchanged when neither side is tensor-parallel."""
    want: dict[str, TPShard | None] = {}
    if module is not None:
        for name, p in module.named_parameters(remove_duplicate=False):
            want[name] = tp_shard(p)
    saved_tp = bool(reader.manifest.get("tp_layout")) or any(
        split_tp_name(n) is not None for n in reader.names("model")
    )
    if not saved_tp and not any(s is not None for s in want.values()):
        return reader
    return TPLayoutReader(reader, want)
