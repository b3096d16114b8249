"""Quadtree variants: partition invariants, greedy parity, degenerate cases, errors."""

from __future__ import annotations

import pytest
import torch

from slipstream.vision import (
    Leaves,
    box_counts,
    fixed_length_quadtree,
    morton_encode,
    summed_area_table,
    threshold_quadtree,
    uniform_leaves,
)


def _edges(batch: int, r: int, p: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Clustered edges (a few dense squares) so trees are deep in places and shallow elsewhere.
    e = torch.rand(batch, r, r, generator=g) < p
    e[:, r // 8 : r // 4, r // 2 : r // 2 + r // 8] = True
    return e


def _assert_partition(leaves: Leaves, min_size: int) -> None:
    r = leaves.image_size
    for b in range(leaves.y.shape[0]):
        v = leaves.valid[b]
        # Padding sits at the end of the row and is flagged with y = x = -1, size 0.
        n = int(v.sum())
        assert v[:n].all() and not v[n:].any()
        assert (leaves.y[b, n:] == -1).all() and (leaves.size[b, n:] == 0).all()
        y, x, s = leaves.y[b, :n], leaves.x[b, :n], leaves.size[b, :n]
        assert ((s & (s - 1)) == 0).all() and (s >= min_size).all()
        assert (y % s == 0).all() and (x % s == 0).all()
        cover = torch.zeros(r, r, dtype=torch.int32)
        for yy, xx, ss in zip(y.tolist(), x.tolist(), s.tolist()):
            cover[yy : yy + ss, xx : xx + ss] += 1
        assert (cover == 1).all(), "leaves must be disjoint and cover the image"
        assert (s * s).sum() == r * r
        assert n % 3 == 1, "count = 1 + 3 * splits"
        unit = int(s.min())
        codes = morton_encode(y // unit, x // unit)
        assert (codes[1:] > codes[:-1]).all(), "leaves must be in Morton order"


@pytest.mark.parametrize("length", [1, 4, 22, 64, 256])
def test_fixed_length_partition_invariants(length: int) -> None:
    """Variant B: disjoint power-of-two leaves covering the image, exactly L entries, padding flagged."""
    leaves = fixed_length_quadtree(_edges(3, 64, 0.02, 0), length, min_size=2)
    assert leaves.length == length and (leaves.num_leaves == length).all()
    _assert_partition(leaves, 2)


@pytest.mark.parametrize("threshold", [0, 5, 40])
def test_threshold_partition_invariants(threshold: int) -> None:
    """Variant A: a valid partition of power-of-two leaves with 1 + 3k of them."""
    _assert_partition(threshold_quadtree(_edges(2, 64, 0.03, 1), threshold, min_size=2), 2)


def test_larger_threshold_gives_fewer_leaves() -> None:
    """Monotonicity (spec 1.5): leaf counts never grow with the split threshold tau."""
    e = _edges(2, 64, 0.03, 1)
    counts = [threshold_quadtree(e, t).num_leaves for t in (0, 5, 20, 60, 200, 5000)]
    for looser, tighter in zip(counts[1:], counts[:-1]):
        assert (looser <= tighter).all()
    assert (counts[-1] == 1).all() and (counts[0] > 100).all()


def _greedy(e: torch.Tensor, length: int, min_size: int) -> list[tuple[int, int, int]]:
    """Reference: the authors' loop, splitting the most-edged leaf in place (ties: bigger, earlier)."""
    leaves = [(0, 0, e.shape[0])]

    def score(leaf: tuple[int, int, int]) -> tuple[int, int]:
        y, x, s = leaf
        count = int(e[y : y + s, x : x + s].sum())
        return (count if s >= 2 * min_size and count > 0 else -1), s

    while len(leaves) < length:
        i = max(range(len(leaves)), key=lambda k: (*score(leaves[k]), -k))
        if score(leaves[i])[0] < 0:
            break
        y, x, s = leaves[i]
        h = s // 2
        leaves[i : i + 1] = [(y, x, h), (y, x + h, h), (y + h, x, h), (y + h, x + h, h)]
    return leaves


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fixed_length_equals_sequential_greedy_splitting(seed: int) -> None:
    """The one-topk construction reproduces the sequential split-the-max loop leaf for leaf."""
    e = _edges(1, 32, 0.08, seed)[0]
    for length in (4, 25, 64, 121):
        leaves = fixed_length_quadtree(e[None], length, min_size=2)
        v = leaves.valid[0]
        got = list(
            zip(leaves.y[0, v].tolist(), leaves.x[0, v].tolist(), leaves.size[0, v].tolist())
        )
        assert got == _greedy(e, length, 2)


def _recursive_threshold(
    e: torch.Tensor, tau: int, max_depth: int, min_size: int, max_size: int
) -> list[tuple[int, int, int]]:
    """The spec's definition, node by node, counting edges with SAT box queries."""
    sat = summed_area_table(e[None])
    zero = torch.zeros(1, dtype=torch.long)
    out = []

    def visit(y: int, x: int, s: int, depth: int) -> None:
        count = int(box_counts(sat, zero, zero + y, zero + x, s))
        if s > max_size or (count > tau and depth < max_depth and s // 2 >= min_size):
            h = s // 2
            for dy, dx in ((0, 0), (0, h), (h, 0), (h, h)):
                visit(y + dy, x + dx, h, depth + 1)
        else:
            out.append((y, x, s))

    visit(0, 0, e.shape[-1], 0)
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_threshold_variant_equals_node_by_node_recursion(seed: int) -> None:
    """Counts read off sorted Morton codes split exactly the nodes the SAT recursion splits."""
    e = _edges(1, 64, 0.04, seed)[0]
    for tau, depth, min_size, max_size in ((0, 10, 1, 64), (3, 10, 2, 64), (20, 3, 2, 64),
                                           (60, 10, 4, 16), (5, 1, 2, 8)):  # fmt: skip
        leaves = threshold_quadtree(
            e[None], tau, max_depth=depth, min_size=min_size, max_size=max_size
        )
        v = leaves.valid[0]
        got = list(
            zip(leaves.y[0, v].tolist(), leaves.x[0, v].tolist(), leaves.size[0, v].tolist())
        )
        assert got == _recursive_threshold(e, tau, depth, min_size, max_size)


def test_empty_edge_map_gives_one_leaf_in_both_variants() -> None:
    """No edges -> the root alone (the fixed-length row is padded, flagged invalid)."""
    e = torch.zeros(2, 64, 64, dtype=torch.bool)
    fixed = fixed_length_quadtree(e, 64)
    assert fixed.num_leaves.tolist() == [1, 1] and fixed.length == 64
    assert fixed.size[:, 0].tolist() == [64, 64]
    assert threshold_quadtree(e, 0).num_leaves.tolist() == [1, 1]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_all_edge_map_with_power_of_four_length_is_the_uniform_grid(k: int) -> None:
    """All-edge map, L = 4**k (or max_depth = k) -> the uniform grid of side R / 2**k, Morton order."""
    e = torch.ones(2, 64, 64, dtype=torch.bool)
    grid = uniform_leaves(2, 64, 64 >> k)
    for leaves in (fixed_length_quadtree(e, 4**k), threshold_quadtree(e, 0, max_depth=k)):
        for name in ("y", "x", "size", "valid"):
            assert torch.equal(getattr(leaves, name), getattr(grid, name)), name


def test_morton_order_of_a_split_is_tl_tr_bl_br() -> None:
    """One split lists the quadrants top-left, top-right, bottom-left, bottom-right."""
    leaves = fixed_length_quadtree(torch.ones(1, 8, 8, dtype=torch.bool), 4)
    assert list(zip(leaves.y[0].tolist(), leaves.x[0].tolist())) == [(0, 0), (0, 4), (4, 0), (4, 4)]


def test_summed_area_table_counts_match_direct_sums() -> None:
    """O(1) SAT box counts (full and cell-pooled tables) equal direct sums over the boxes."""
    e = _edges(2, 128, 0.1, 3)
    for cell in (1, 4):
        sat = summed_area_table(e, cell)
        assert sat.shape == (2, 128 // cell + 1, 128 // cell + 1)
        g = torch.Generator().manual_seed(4)
        for _ in range(20):
            b = int(torch.randint(2, (1,), generator=g))
            s = cell * int(torch.randint(1, 128 // cell, (1,), generator=g))
            y = cell * int(torch.randint(0, (128 - s) // cell + 1, (1,), generator=g))
            x = cell * int(torch.randint(0, (128 - s) // cell + 1, (1,), generator=g))
            got = box_counts(
                sat,
                torch.tensor([b]),
                torch.tensor([y // cell]),
                torch.tensor([x // cell]),
                s // cell,
            )
            assert int(got) == int(e[b, y : y + s, x : x + s].sum())


def test_max_size_forces_splits_and_min_size_stops_them() -> None:
    """No leaf exceeds max_size even without edges; no leaf goes below min_size."""
    e = torch.zeros(1, 64, 64, dtype=torch.bool)
    leaves = fixed_length_quadtree(e, 64, max_size=16)
    assert int(leaves.size[leaves.valid].max()) == 16 and int(leaves.num_leaves) == 16
    dense = fixed_length_quadtree(torch.ones(1, 64, 64, dtype=torch.bool), 1024, min_size=4)
    assert int(dense.size[dense.valid].min()) == 4 and int(dense.num_leaves) == 256
    assert int(threshold_quadtree(e, 0, max_size=32).num_leaves) == 4


def test_threshold_variant_fits_rows_to_length() -> None:
    """Short rows are padded to `length`; long rows keep a random `length` leaves, still in Morton order."""
    e = _edges(2, 64, 0.05, 5)
    full = threshold_quadtree(e, 4)
    n = int(full.num_leaves.min())
    longer = threshold_quadtree(e, 4, length=int(full.num_leaves.max()) + 10)
    assert torch.equal(longer.num_leaves, full.num_leaves)
    short = threshold_quadtree(e, 4, length=n // 2, generator=torch.Generator().manual_seed(0))
    assert (short.num_leaves == n // 2).all()
    codes = morton_encode(short.y[0], short.x[0])
    assert (codes[1:] > codes[:-1]).all()


def test_quadtree_argument_errors_name_the_fix() -> None:
    """Bad length, non-power-of-two side, bad min_size and over-forcing max_size raise clearly."""
    e = torch.zeros(1, 64, 64, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"length=576 is not 1 mod 3.*length=574 or 577"):
        fixed_length_quadtree(e, 576)
    with pytest.raises(ValueError, match="R=48 is not a power of two"):
        fixed_length_quadtree(torch.zeros(1, 48, 48), 4)
    with pytest.raises(ValueError, match="max_size=1 must be a power of two >= min_size=2"):
        threshold_quadtree(e, 1, max_size=1)
    with pytest.raises(ValueError, match="min_size=3"):
        threshold_quadtree(e, 1, min_size=3)
    with pytest.raises(
        ValueError, match=r"forces 85 splits but length=64 allows only 21; raise length to >= 256"
    ):
        fixed_length_quadtree(e, 64, max_size=4)
