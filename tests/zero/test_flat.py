"""``Bucket.param_slice`` / ``FlatSlice``, the one answer to "which part of this parameter is in
a rank's shard", checked element by element against a brute-force reference."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from slipstream.zero.flat import Bucket, FlatSlice, build_buckets

SHAPES = [(5,), (3, 4), (7,), (1,), (0,), (2, 3, 2), (13,)]


def _buckets(shapes: list[tuple[int, ...]], dp: int, bucket_numel: int) -> list[Bucket]:
    params = [nn.Parameter(torch.zeros(s)) for s in shapes]
    names = {p: f"p{i}" for i, p in enumerate(params)}
    buckets = build_buckets([params], names, bucket_numel, dp)
    for b in buckets:  # element k of the bucket holds the value k
        b.flat.copy_(torch.arange(b.numel, dtype=b.flat.dtype))
    return buckets


@pytest.mark.parametrize("dp", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("bucket_numel", [1, 10, 1000])
def test_param_slice_matches_brute_force(dp: int, bucket_numel: int) -> None:
    for bucket in _buckets(SHAPES, dp, bucket_numel):
        assert bucket.numel % dp == 0 and bucket.numel >= sum(bucket.numels)
        for i, p in enumerate(bucket.params):
            off, n = bucket.offsets[i], bucket.numels[i]
            covered: list[int] = []
            holders = 0
            for rank in range(dp):
                region = bucket.shard_slice(rank)
                lo, hi = region.start, region.stop
                mine = bucket.param_slice(i, lo, hi)
                expected = [k for k in range(off, off + n) if lo <= k < hi]
                assert mine.numel == len(expected) and bool(mine) == bool(expected)
                shard = bucket.flat[lo:hi]
                # Where it sits in the shard, and which of the parameter's elements it is.
                assert shard[mine.at(lo)].tolist() == expected
                assert p.detach().reshape(-1)[mine.param].tolist() == expected
                assert 0 <= mine.at(lo).start <= mine.at(lo).stop <= hi - lo  # in bounds
                covered += [k - off for k in expected]
                holders += bool(expected)
            assert covered == list(range(n))  # every element in exactly one rank's shard
            assert bucket.is_split(i) == (holders > 1)
            whole = bucket.param_slice(i)
            assert (whole.start, whole.stop, whole.param) == (off, off + n, slice(0, n))


def test_within_is_an_intersection_and_rebases() -> None:
    s = FlatSlice.whole(offset=10, numel=8)  # bucket elements [10, 18)
    assert s.within(12, 15) == FlatSlice(10, 12, 15)
    assert s.within(12, 15).param == slice(2, 5)
    assert s.within(12, 15).at(12) == slice(0, 3)
    assert s.within(0, 100) == s
    # A chunk of a parameter keeps the parameter's offset: its ``param`` is inside the param.
    chunk = FlatSlice(10, 14, 18).within(0, 16)
    assert (chunk.param, chunk.at(14)) == (slice(4, 6), slice(0, 2))
    # Empty answers sit at the nearest edge of the region, inside it.
    before, after = s.within(20, 30), s.within(0, 5)
    assert not before and not after
    assert before.at(20) == slice(0, 0) and after.at(0) == slice(5, 5)
