"""Implicit-feedback data: user-item pairs, filtering, per-user splits, histories.

Everything here is numpy on the host: the trainers read these arrays directly. A data set
is a :class:`InteractionSplit` of contiguous ids ``0..num_users-1`` / ``0..num_items-1``.

MovieLens-100K is read from the ``recbole`` wheel when it is installed
(``pip install --no-deps recbole==1.2.1``): the GroupLens licence forbids redistributing
it, so slipstream never ships or downloads it. :func:`synthetic_interactions` makes a data
set of any size with planted cluster structure for tests and benchmarks without it.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "InteractionSplit",
    "filter_interactions",
    "load_atomic_interactions",
    "load_movielens_100k",
    "movielens_100k_path",
    "split_per_user",
    "synthetic_interactions",
    "user_history",
]


@dataclass(frozen=True)
class InteractionSplit:
    """A train/test split of implicit feedback over contiguous user and item ids.

    Attributes:
        num_users: users are ``0..num_users-1``.
        num_items: items are ``0..num_items-1``.
        train: ``[n_train, 2]`` int64 array of ``(user, item)`` pairs, no duplicates.
        test: ``[n_test, 2]`` int64 array of held-out ``(user, item)`` pairs, disjoint from
            ``train``.
    """

    num_users: int
    num_items: int
    train: np.ndarray
    test: np.ndarray

    def __post_init__(self) -> None:
        for name in ("train", "test"):
            pairs = getattr(self, name)
            if pairs.ndim != 2 or pairs.shape[1] != 2:
                raise ValueError(
                    f"InteractionSplit.{name} must have shape [n, 2] (user, item), got "
                    f"{tuple(pairs.shape)}; stack the two id columns with np.stack(..., axis=1)"
                )
            if pairs.size and (pairs.min(0) < 0).any():
                raise ValueError(f"InteractionSplit.{name} has negative ids; remap ids to 0..n-1")
            if pairs.size and (pairs[:, 0].max() >= self.num_users):
                raise ValueError(
                    f"InteractionSplit.{name} has user id {int(pairs[:, 0].max())} >= "
                    f"num_users={self.num_users}; pass the true user count"
                )
            if pairs.size and (pairs[:, 1].max() >= self.num_items):
                raise ValueError(
                    f"InteractionSplit.{name} has item id {int(pairs[:, 1].max())} >= "
                    f"num_items={self.num_items}; pass the true item count"
                )

    def item_popularity(self) -> np.ndarray:
        """Train-set interaction count per item, ``[num_items]`` int64."""
        return np.bincount(self.train[:, 1], minlength=self.num_items)


def movielens_100k_path() -> Path:
    """Path of ``ml-100k.inter`` inside the installed ``recbole`` package.

    Raises:
        FileNotFoundError: recbole is not installed (or its wheel lacks the file).
    """
    spec = importlib.util.find_spec("recbole")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "MovieLens-100K is read from the recbole wheel, which is not installed; run "
            "`pip install --no-deps recbole==1.2.1` (the data may not be redistributed, so "
            "slipstream does not ship it), or use synthetic_interactions()"
        )
    path = Path(spec.submodule_search_locations[0]) / "dataset_example/ml-100k/ml-100k.inter"
    if not path.is_file():
        raise FileNotFoundError(f"recbole is installed but {path} is missing; reinstall recbole")
    return path


def load_atomic_interactions(path: str | Path) -> np.ndarray:
    """Read a RecBole atomic ``.inter`` file into ``[n, 2]`` raw ``(user, item)`` ids.

    The file is tab-separated with a header naming ``user_id:token`` and
    ``item_id:token`` columns; every row is taken as an implicit positive (ratings and
    timestamps are ignored). Ids are returned as in the file (use
    :func:`filter_interactions` to make them contiguous).
    """
    path = Path(path)
    with path.open(encoding="utf-8") as f:
        header = f.readline().rstrip("\n").split("\t")
        names = [h.split(":")[0] for h in header]
        if "user_id" not in names or "item_id" not in names:
            raise ValueError(
                f"{path}: header {header} has no user_id/item_id columns; expected a RecBole "
                "atomic .inter file"
            )
        cols = (names.index("user_id"), names.index("item_id"))
        raw = np.loadtxt(f, delimiter="\t", usecols=cols, dtype=np.int64, ndmin=2)
    return raw


def filter_interactions(
    pairs: np.ndarray, min_user_count: int = 1, min_item_count: int = 1
) -> tuple[np.ndarray, int, int]:
    """Deduplicate, k-core filter and remap ``(user, item)`` pairs to contiguous ids.

    Users with fewer than ``min_user_count`` and items with fewer than ``min_item_count``
    interactions are removed repeatedly until both constraints hold (k-core).

    Returns:
        ``(pairs, num_users, num_items)`` with ids remapped to ``0..n-1`` in sorted
        order of the original ids.
    """
    if min_user_count < 1 or min_item_count < 1:
        raise ValueError(
            f"min_user_count and min_item_count must be >= 1, got {min_user_count}, "
            f"{min_item_count}"
        )
    pairs = np.unique(np.asarray(pairs, dtype=np.int64), axis=0)
    while True:
        users, uinv, ucount = np.unique(pairs[:, 0], return_inverse=True, return_counts=True)
        items, iinv, icount = np.unique(pairs[:, 1], return_inverse=True, return_counts=True)
        keep = (ucount[uinv] >= min_user_count) & (icount[iinv] >= min_item_count)
        if keep.all():
            break
        pairs = pairs[keep]
    return np.stack([uinv, iinv], axis=1).astype(np.int64), len(users), len(items)


def split_per_user(
    pairs: np.ndarray, num_users: int, num_items: int, test_fraction: float = 0.2, seed: int = 0
) -> InteractionSplit:
    """Random per-user split: each user's items are shuffled, ``round(test_fraction * n)`` go
    to test (at least one when the user has two or more items), the rest to train.

    Deterministic for a given ``seed`` (numpy ``default_rng``); users are visited in id order.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    rng = np.random.default_rng(seed)
    order = np.argsort(pairs[:, 0], kind="stable")
    pairs = pairs[order]
    bounds = np.searchsorted(pairs[:, 0], np.arange(num_users + 1))
    train_parts, test_parts = [], []
    for u in range(num_users):
        items = pairs[bounds[u] : bounds[u + 1], 1]
        if len(items) == 0:
            continue
        items = rng.permutation(items)
        n_test = round(test_fraction * len(items))
        n_test = min(max(n_test, 1 if len(items) >= 2 else 0), len(items) - 1)
        user_col = np.full(len(items), u, dtype=np.int64)
        test_parts.append(np.stack([user_col[:n_test], items[:n_test]], 1))
        train_parts.append(np.stack([user_col[n_test:], items[n_test:]], 1))
    return InteractionSplit(
        num_users,
        num_items,
        np.concatenate(train_parts).astype(np.int64),
        np.concatenate(test_parts).astype(np.int64),
    )


def load_movielens_100k(test_fraction: float = 0.2, seed: int = 0) -> InteractionSplit:
    """MovieLens-100K (943 users, 1,682 items, 100,000 ratings as implicit positives),
    split per user with :func:`split_per_user`; needs ``recbole`` (see
    :func:`movielens_100k_path`)."""
    pairs, num_users, num_items = filter_interactions(
        load_atomic_interactions(movielens_100k_path())
    )
    return split_per_user(pairs, num_users, num_items, test_fraction, seed)


def synthetic_interactions(
    num_users: int = 943,
    num_items: int = 1682,
    num_interactions: int = 100_000,
    num_clusters: int = 8,
    in_cluster: float = 0.8,
    test_fraction: float = 0.2,
    seed: int = 0,
) -> InteractionSplit:
    """Implicit feedback with planted structure, split per user.

    Users and items are assigned round-robin to ``num_clusters`` clusters. Each user
    draws its items (without repetition) with probability ``in_cluster`` from its own
    cluster and otherwise from all items, in both cases with Zipf-like popularity
    (weight ``1/sqrt(rank)``). A model that learns the clusters ranks held-out items far
    better than item popularity does; defaults match MovieLens-100K's size.
    """
    if not 0.0 <= in_cluster <= 1.0:
        raise ValueError(f"in_cluster must be in [0, 1], got {in_cluster}")
    if num_interactions > num_users * num_items // 2:
        raise ValueError(
            f"num_interactions={num_interactions} is over half of num_users*num_items="
            f"{num_users * num_items}; ask for fewer interactions or more users/items"
        )
    rng = np.random.default_rng(seed)
    item_cluster = np.arange(num_items) % num_clusters
    weight = 1.0 / np.sqrt(1.0 + rng.permutation(num_items))
    # per-user activity: log-normal so a few users are heavy, every user has >= 5 items
    activity = rng.lognormal(0.0, 0.6, num_users)
    counts = np.maximum(5, np.round(activity / activity.sum() * num_interactions)).astype(int)
    counts = np.minimum(counts, num_items // 2)
    pairs = []
    for u in range(num_users):
        in_c = item_cluster == u % num_clusters
        p = weight * np.where(in_c, in_cluster / weight[in_c].sum(), 0.0)
        p += weight * (1.0 - in_cluster) / weight.sum()
        items = rng.choice(num_items, size=counts[u], replace=False, p=p / p.sum())
        pairs.append(np.stack([np.full(counts[u], u), items], 1))
    all_pairs = np.concatenate(pairs).astype(np.int64)
    return split_per_user(all_pairs, num_users, num_items, test_fraction, seed)


def user_history(
    train: np.ndarray, num_users: int, max_len: int, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Each user's behaviour history (SimpleX §3.2) as CSR arrays.

    A user with more than ``max_len`` train items keeps a fixed random subset of
    ``max_len`` (``seed``); order within a history does not matter (mean pooling).

    Returns:
        ``(indptr [num_users + 1] int64, items [nnz] int64)``: user ``u``'s history is
        ``items[indptr[u]:indptr[u + 1]]``.
    """
    if max_len < 1:
        raise ValueError(f"max_len (max_history) must be >= 1, got {max_len}")
    rng = np.random.default_rng(seed)
    perm = rng.permutation(len(train))
    order = perm[np.argsort(train[perm, 0], kind="stable")]
    users, items = train[order, 0], train[order, 1]
    starts = np.searchsorted(users, np.arange(num_users))
    rank = np.arange(len(users)) - starts[users]
    keep = rank < max_len
    counts = np.bincount(users[keep], minlength=num_users)
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return indptr, items[keep].astype(np.int64)
