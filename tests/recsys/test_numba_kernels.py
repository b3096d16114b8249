"""Tests for the HEAT random-tiling negative sampler (slipstream/recsys/_numba_kernels.py)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")

from slipstream.recsys._numba_kernels import sample_negatives

CHI2_999_DOF49 = 85.4  # 0.999 quantile of chi-squared with 49 degrees of freedom


def test_negatives_come_from_the_current_tile_and_tiles_refresh_every_n2_samples() -> None:
    """Sample s draws only from tile s // N2, and consecutive tiles differ."""
    negs, tiles = sample_negatives(100, 7, 1000, 16, 8, 11)
    assert negs.shape == (100, 7) and tiles.shape == (13, 16)
    for s in range(100):
        assert set(negs[s]) <= set(tiles[s // 8])
    assert all(not np.array_equal(tiles[r], tiles[r + 1]) for r in range(12))


def test_tiled_sampling_is_uniform_over_many_refreshes() -> None:
    """Tile contents, and single draws from fresh tiles, are uniform over items (chi², p > 0.001).

    (Counts of many draws from the same tile are over-dispersed by design, so the test
    checks the two independent stages.)"""
    _, tiles = sample_negatives(2000, 5, 50, 10, 4, 3)  # 500 tiles of 10
    one_per_tile, _ = sample_negatives(5000, 1, 50, 10, 1, 4)
    for draws in (tiles.ravel(), one_per_tile.ravel()):
        counts = np.bincount(draws, minlength=50)
        expected = draws.size / 50
        assert ((counts - expected) ** 2 / expected).sum() < CHI2_999_DOF49


def test_full_tile_reproduces_the_uniform_sampler() -> None:
    """N1 = |I| (any N2) gives exactly the uniform sampler's draws from the same seed."""
    uniform, no_tiles = sample_negatives(50, 4, 30, 0, 1, 9)
    full, _ = sample_negatives(50, 4, 30, 30, 1, 9)
    assert no_tiles.size == 0 and np.array_equal(uniform, full)
    assert uniform.min() >= 0 and uniform.max() < 30 and len(np.unique(uniform)) > 20
