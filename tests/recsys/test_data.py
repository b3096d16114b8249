"""Tests for implicit-feedback data handling (slipstream/recsys/data.py)."""

from __future__ import annotations

import numpy as np
import pytest

from slipstream.recsys.data import (
    InteractionSplit,
    filter_interactions,
    load_atomic_interactions,
    load_movielens_100k,
    split_per_user,
    synthetic_interactions,
    user_history,
)


def _pairs_set(a: np.ndarray) -> set[tuple[int, int]]:
    return {(int(u), int(i)) for u, i in a}


def test_split_is_disjoint_complete_and_about_80_20_per_user() -> None:
    """Per-user split covers every pair once, keeps >= 1 train item, ~20% test, deterministic."""
    rng = np.random.default_rng(1)
    pairs = np.unique(np.stack([rng.integers(0, 30, 2000), rng.integers(0, 200, 2000)], 1), axis=0)
    split = split_per_user(pairs, 30, 200, test_fraction=0.2, seed=3)
    train, test = _pairs_set(split.train), _pairs_set(split.test)
    assert not train & test and train | test == _pairs_set(pairs)
    for u in range(30):
        n_tr, n_te = (split.train[:, 0] == u).sum(), (split.test[:, 0] == u).sum()
        assert n_tr >= 1 and abs(n_te - 0.2 * (n_tr + n_te)) <= 0.5
    again = split_per_user(pairs, 30, 200, test_fraction=0.2, seed=3)
    assert np.array_equal(again.test, split.test)


def test_filter_is_an_iterated_k_core_with_contiguous_ids() -> None:
    """Filtering repeats until every user and item meets its minimum, then remaps ids 0..n-1."""
    # user 9 has one item; dropping it leaves item 50 with one user (3), whose removal
    # leaves user 3 with one item: only users 1, 2 and items 10, 20 survive
    pairs = np.array([[1, 10], [1, 20], [2, 10], [2, 20], [9, 50], [3, 50], [3, 20]])
    out, n_users, n_items = filter_interactions(np.vstack([pairs, pairs]), 2, 2)
    assert (n_users, n_items) == (2, 2)
    assert sorted(map(tuple, out.tolist())) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    out1, n_u1, n_i1 = filter_interactions(pairs)  # no filtering: dedup + remap only
    assert (n_u1, n_i1, len(out1)) == (4, 3, 7) and out1.max(0).tolist() == [3, 2]


def test_user_history_caps_length_and_uses_train_items_only() -> None:
    """History CSR keeps min(n, max_len) of each user's own train items."""
    train = np.array([[0, i] for i in range(7)] + [[2, 3], [2, 4]])
    indptr, items = user_history(train, 3, max_len=5)
    assert list(np.diff(indptr)) == [5, 0, 2]
    assert set(items[:5]) <= set(range(7)) and len(set(items[:5])) == 5
    assert set(items[5:]) == {3, 4}
    with pytest.raises(ValueError, match="max_len"):
        user_history(train, 3, max_len=0)


def test_atomic_file_reader_and_bad_header(tmp_path) -> None:
    """RecBole .inter files are read by column name; a file without the columns is refused."""
    good = tmp_path / "x.inter"
    good.write_text("rating:float\tuser_id:token\titem_id:token\n5\t7\t3\n4\t8\t3\n")
    assert load_atomic_interactions(good).tolist() == [[7, 3], [8, 3]]
    bad = tmp_path / "y.inter"
    bad.write_text("a:token\tb:token\n1\t2\n")
    with pytest.raises(ValueError, match="no user_id/item_id"):
        load_atomic_interactions(bad)


def test_split_validation_names_the_array_and_fix() -> None:
    """InteractionSplit rejects ids beyond num_items with a message naming the field."""
    with pytest.raises(ValueError, match=r"test has item id 9 >= num_items=5"):
        InteractionSplit(2, 5, np.array([[0, 1]]), np.array([[1, 9]]))


def test_synthetic_data_has_planted_clusters() -> None:
    """Most of each user's items come from the user's own cluster (in_cluster=0.8)."""
    split = synthetic_interactions(120, 200, 4000, num_clusters=4, in_cluster=0.8, seed=0)
    pairs = np.vstack([split.train, split.test])
    same = (pairs[:, 0] % 4) == (pairs[:, 1] % 4)
    assert 3600 <= len(pairs) <= 4400 and same.mean() > 0.6  # 0.25 without structure


def test_movielens_100k_from_recbole() -> None:
    """ML-100K from the recbole wheel: 943 users, 1,682 items, 80k/20k split."""
    pytest.importorskip("recbole")
    split = load_movielens_100k()
    assert (split.num_users, split.num_items) == (943, 1682)
    assert len(split.train) + len(split.test) == 100_000 and len(split.test) == 20_000
