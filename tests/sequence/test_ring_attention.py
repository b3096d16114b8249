"""Ring attention (zig-zag) and Ulysses x ring equal single-rank attention in fp64, output and
gradients: GQA with KV heads not dividing P, packed documents, non-causal; 2 and 4 ranks;
both block paths (PyTorch's fused CPU attention, the tiled formula)."""

from __future__ import annotations

import pytest
import torch

from slipstream.sequence.ring import (
    sequence_shard_indices,
    shard_sequence_zigzag,
    unshard_sequence_zigzag,
)
from tests.distributed.harness import run_world
from tests.sequence import _ring_workloads as w

# (seq_len, ring, ulysses, heads, kv heads, causal, packed)
CASES2 = [
    (16, 2, 1, 3, 1, True, False),  # 3 query heads, 1 KV head over 2 ranks (Ulysses cannot)
    (24, 2, 1, 4, 2, True, True),  # packed documents crossing the chunk boundaries
    (16, 2, 1, 2, 2, False, False),  # no causal mask
    (16, 1, 2, 4, 1, True, False),  # pure Ulysses through the same entry (ring of one)
]
CASES4 = [
    (32, 4, 1, 3, 3, True, True),  # ring of 4, heads not divisible by 4
    (32, 2, 2, 4, 1, True, False),  # Ulysses 2 x ring 2: P=4 exceeds the single KV head
]
TOL = 1e-10  # fp64; the largest entries are O(1)


def _check(results: list[dict], cases: list[w.Case]) -> None:
    for rank, per_case in enumerate(results):
        for case in cases:
            for path in ("fused", "tiled"):
                errors = per_case[(case, path)]
                assert errors["scale"] > 0.1, (case, errors)
                for name in ("out", "dq", "dk", "dv"):
                    assert errors[name] < TOL, (rank, case, path, name, errors)


def test_ring_two_ranks_equal_single_rank_fp64():
    _check(run_world(w.kernel_world, 2, CASES2), CASES2)


def test_ring_and_usp_four_ranks_equal_single_rank_fp64():
    _check(run_world(w.kernel_world, 4, CASES4), CASES4)


def test_zigzag_layout():
    """Rank i of R holds chunks i and 2R-1-i; Ulysses parts split each ring piece; the
    inverse restores the sequence; lengths that do not split are refused naming the fix."""
    assert sequence_shard_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert sequence_shard_indices(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert sequence_shard_indices(16, 2, 1, ulysses_size=2).tolist() == [12, 13, 14, 15]
    x = torch.arange(24).view(1, 24)
    shards = [shard_sequence_zigzag(x, 3, r) for r in range(3)]
    assert torch.equal(unshard_sequence_zigzag(shards, 3), x)
    with pytest.raises(ValueError, match="pad it to a multiple of 4"):
        sequence_shard_indices(10, 2, 0, ulysses_size=2)
    with pytest.raises(ValueError, match="pad it to a multiple of 12"):
        sequence_shard_indices(16, 2, 0, ulysses_size=3)


def test_ring_config_keys_are_checked():
    """sequence_parallel_ring_size needs ring mode and must divide sequence_parallel_size;
    an unknown mode is refused by the schema."""
    from slipstream.config import ConfigError
    from slipstream.config.loader import parse_config

    base = {"train_batch_size": 1, "sequence_parallel_size": 4}
    cfg = parse_config(dict(base, sequence_parallel_mode="ring", sequence_parallel_ring_size=2))
    assert (cfg.sequence_parallel_mode, cfg.sequence_parallel_ring_size) == ("ring", 2)
    with pytest.raises(ConfigError, match="needs sequence_parallel_mode 'ring'"):
        parse_config(dict(base, sequence_parallel_ring_size=2))
    with pytest.raises(ConfigError, match="= 3 does not divide sequence_parallel_size = 4"):
        parse_config(dict(base, sequence_parallel_mode="ring", sequence_parallel_ring_size=3))
    with pytest.raises(Exception, match="sequence_parallel_mode"):
        parse_config(dict(base, sequence_parallel_mode="context"))
