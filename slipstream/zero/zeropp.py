"""ZeRO++ on the weight side of ZeRO-3 (Wang et al. 2023): its options, hpZ's secondary shards
and the int8 store of frozen weights.

- qwZ (section 3.1): the weight all-gathers send int8 block-quantized codes; the store passes
  ``ZeroPPWeights.quantize`` to the comm layer's quantized all-gather.
- hpZ (section 3.2): when a unit is released after its forward, each rank keeps a secondary
  copy of its 1/G slice of the unit (G = ``hpz_size`` consecutive ranks, usually one node), so
  the backward all-gather stays inside the node. :class:`SecondaryShards` holds those copies;
  an optimizer step makes them stale.
- ``zero_quantized_nontrainable_weights``: frozen weights are kept as int8 block codes
  (:class:`FrozenInt8`) and dequantized while their unit runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from slipstream.distributed import comm
from slipstream.distributed.quantize import QuantizedBlocks, dequantize_blocks
from slipstream.zero.flat import Bucket
from slipstream.zero.param import bind_, release_

__all__ = ["FrozenInt8", "SecondaryShards", "ZeroPPWeights"]


@dataclass(frozen=True)
class ZeroPPWeights:
    """ZeRO++ options of the weight all-gathers.

    Attributes:
        quantize: qwZ, all-gather int8 block-quantized codes (``zero_quantized_weights``).
        block: elements per quantization block.
        hpz_group: hpZ, the group of ``hpz_size`` consecutive ranks holding a secondary copy
            of each released unit; the backward all-gather stays inside it. None disables.
        hpz_size: size of ``hpz_group``.
        quantize_frozen: store frozen (``requires_grad=False``) weights as int8 codes,
            dequantized per unit while it runs (``zero_quantized_nontrainable_weights``).
    """

    quantize: bool = False
    block: int = 2048
    hpz_group: comm.Group = None
    hpz_size: int = 1
    quantize_frozen: bool = False

    @property
    def hpz(self) -> bool:
        return self.hpz_group is not None and self.hpz_size > 1


@dataclass
class FrozenInt8:
    """A frozen weight stored as int8 block codes (``zero_quantized_nontrainable_weights``);
    ``buf`` (which the parameter views) holds its dequantized values only while its unit is
    gathered."""

    param: nn.Parameter
    buf: torch.Tensor
    codes: QuantizedBlocks
    empty: torch.Tensor  # what the parameter is while released

    def fill(self) -> None:
        self.buf.untyped_storage().resize_(self.buf.numel() * self.buf.element_size())
        dequantize_blocks(self.codes, out=self.buf)
        bind_(self.param, self.buf.view(self.param.ds_shape))  # type: ignore[attr-defined]

    def free(self, hand_off: bool = False) -> None:
        """Drop the dequantized values (see :meth:`ShardedStore.release` for ``hand_off``)."""
        release_(self.param, self.empty)
        if hand_off or not self.buf.untyped_storage().resizable():
            self.buf = torch.empty_like(self.buf)
        self.buf.untyped_storage().resize_(0)

    def nbytes(self) -> int:
        return self.codes.codes.numel() + 4 * self.codes.scales.numel()


class SecondaryShards:
    """hpZ's secondary copies: for each bucket, this rank's 1/G slice of the full bucket.

    Args:
        buckets: every bucket of the store.
        skip: indices of buckets that get no copy (persistent units are never released).
        group: the hpZ group (G consecutive ranks); this rank's slice is its rank in it.
        size: G.
    """

    def __init__(
        self, buckets: Sequence[Bucket], skip: set[int], group: comm.Group, size: int
    ) -> None:
        self.group = group
        self.rank = comm.get_rank(group)
        self.copies: list[torch.Tensor | None] = [
            None if b.index in skip else b.flat.new_empty(b.numel // size) for b in buckets
        ]
        self.valid = [False] * len(self.copies)

    def source(self, b: int) -> torch.Tensor | None:
        """The copy of bucket ``b`` to all-gather from inside the group, if it is current."""
        return self.copies[b] if self.valid[b] else None

    @torch.no_grad()
    def keep(self, b: int, flat: torch.Tensor) -> None:
        """Before bucket ``b``'s full storage ``flat`` is freed: copy this rank's slice, unless
        the copy is still current."""
        copy = self.copies[b]
        if copy is None or self.valid[b]:
            return
        n = copy.numel()
        copy.copy_(flat[self.rank * n : (self.rank + 1) * n])
        self.valid[b] = True

    def invalidate(self, b: int) -> None:
        """Bucket ``b``'s weights changed (an optimizer step)."""
        self.valid[b] = False

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.copies if t is not None)
