"""Full-ranking evaluation: Recall@K and NDCG@K with training items masked.

Every item is ranked for every user (no sampled candidates). For a user with test set
``T`` and top-K list ``R`` (train items excluded):

- Recall@K = |R ∩ T| / |T|
- NDCG@K = Σ_{r ≤ K} 1[R_r ∈ T] / log2(r + 1), divided by the ideal DCG with
  min(|T|, K) relevant items at the top.

Both are averaged over the users with at least one test item (HEAT §5.1 / SimpleX §4.1).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from slipstream.recsys.data import InteractionSplit

__all__ = ["evaluate_topk", "popularity_scores"]

ScoreFn = Callable[[torch.Tensor], torch.Tensor]


def _csr(pairs: np.ndarray, num_users: int) -> tuple[np.ndarray, np.ndarray]:
    order = np.argsort(pairs[:, 0], kind="stable")
    indptr = np.searchsorted(pairs[order, 0], np.arange(num_users + 1))
    return indptr, pairs[order, 1]


def evaluate_topk(
    score_fn: ScoreFn, split: InteractionSplit, k: int = 20, user_batch: int = 1024
) -> dict[str, float]:
    """Recall@k and NDCG@k of ``score_fn`` on ``split.test``, train items masked.

    Args:
        score_fn: maps a 1-D int64 tensor of user ids ``[b]`` to scores ``[b, num_items]``
            (higher is better).
        split: the data; ``split.train`` items are excluded from each user's ranking.
        k: cut-off.
        user_batch: users scored at once (memory is ``user_batch * num_items`` floats).

    Returns:
        ``{"recall": ..., "ndcg": ..., "users": n}`` averaged over users with test items.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    tr_ptr, tr_items = _csr(split.train, split.num_users)
    te_ptr, te_items = _csr(split.test, split.num_users)
    users = np.flatnonzero(np.diff(te_ptr) > 0)
    discounts = 1.0 / np.log2(np.arange(2, k + 2))
    ideal = np.cumsum(discounts)
    recall_sum = ndcg_sum = 0.0
    for start in range(0, len(users), user_batch):
        batch = users[start : start + user_batch]
        with torch.no_grad():
            scores = score_fn(torch.as_tensor(batch, dtype=torch.int64)).float().clone()
        if scores.shape != (len(batch), split.num_items):
            raise ValueError(
                f"score_fn returned shape {tuple(scores.shape)} for {len(batch)} users; "
                f"expected ({len(batch)}, {split.num_items})"
            )
        rows = np.repeat(np.arange(len(batch)), tr_ptr[batch + 1] - tr_ptr[batch])
        cols = np.concatenate([tr_items[tr_ptr[u] : tr_ptr[u + 1]] for u in batch])
        scores[torch.as_tensor(rows), torch.as_tensor(cols)] = -torch.inf
        top = torch.topk(scores, min(k, split.num_items), dim=1).indices.numpy()
        relevant = np.zeros((len(batch), split.num_items), dtype=bool)
        n_test = te_ptr[batch + 1] - te_ptr[batch]
        rows = np.repeat(np.arange(len(batch)), n_test)
        cols = np.concatenate([te_items[te_ptr[u] : te_ptr[u + 1]] for u in batch])
        relevant[rows, cols] = True
        hits = np.take_along_axis(relevant, top, axis=1)
        recall_sum += float((hits.sum(1) / n_test).sum())
        dcg = (hits * discounts[: hits.shape[1]]).sum(1)
        ndcg_sum += float((dcg / ideal[np.minimum(n_test, k) - 1]).sum())
    n = max(len(users), 1)
    return {"recall": recall_sum / n, "ndcg": ndcg_sum / n, "users": float(len(users))}


def popularity_scores(split: InteractionSplit) -> ScoreFn:
    """Score function ranking every user's items by train-set popularity (the floor a
    collaborative-filtering model must beat)."""
    pop = torch.as_tensor(split.item_popularity(), dtype=torch.float32)
    return lambda users: pop.expand(len(users), -1)
