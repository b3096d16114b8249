"""Tests for full-ranking Recall@K / NDCG@K (slipstream/recsys/metrics.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from slipstream.recsys.data import InteractionSplit
from slipstream.recsys.metrics import evaluate_topk, popularity_scores


def _split() -> InteractionSplit:
    # user 0: train {0}, test {1, 3}; user 1: train {2}, test {4}; user 2: no test items
    train = np.array([[0, 0], [1, 2], [2, 1]])
    test = np.array([[0, 1], [0, 3], [1, 4]])
    return InteractionSplit(3, 6, train, test)


SCORES = torch.tensor(
    [
        [9.0, 8.0, 7.0, 6.0, 5.0, 4.0],  # ranking without item 0: 1, 2, 3, ...
        [1.0, 2.0, 9.0, 3.0, 0.0, 4.0],  # without item 2: 5, 3, 1, 0, 4
        [0.0] * 6,
    ]
)


def test_hand_made_case() -> None:
    """Recall@2 / NDCG@2 match a by-hand computation, train items masked, users w/o test skipped."""
    out = evaluate_topk(lambda users: SCORES[users], _split(), k=2)
    # user 0 top-2 = [1, 2]: 1 hit of 2 -> recall 1/2; DCG = 1, IDCG = 1 + 1/log2(3)
    # user 1 top-2 = [5, 3]: 0 hits
    assert out["users"] == 2
    assert out["recall"] == pytest.approx((0.5 + 0.0) / 2)
    assert out["ndcg"] == pytest.approx((1.0 / (1.0 + 1.0 / math.log2(3)) + 0.0) / 2)
    out5 = evaluate_topk(lambda users: SCORES[users], _split(), k=5)
    # user 1 top-5 = [5, 3, 1, 0, 4]: hit at rank 5 -> DCG 1/log2(6), IDCG 1
    dcg0 = 1.0 + 1.0 / math.log2(4)  # user 0 top-5 = [1, 2, 3, 4, 5]: hits at ranks 1, 3
    idcg0 = 1.0 + 1.0 / math.log2(3)
    assert out5["recall"] == pytest.approx(1.0)
    assert out5["ndcg"] == pytest.approx((dcg0 / idcg0 + 1.0 / math.log2(6)) / 2)


def test_train_items_never_ranked() -> None:
    """A train item with the top score is masked, so a perfect oracle on test items gets 1.0."""
    split = _split()
    oracle = torch.zeros(3, 6)
    oracle[0, [1, 3]] = 1.0
    oracle[1, 4] = 1.0
    oracle[0, 0] = oracle[1, 2] = 100.0  # each user's own train item
    out = evaluate_topk(lambda users: oracle[users], split, k=2)
    assert out["recall"] == pytest.approx(1.0) and out["ndcg"] == pytest.approx(1.0)


def test_popularity_and_shape_check() -> None:
    """Popularity scores every user alike by train counts; a wrong score shape is an error."""
    split = _split()
    pop = popularity_scores(split)(torch.tensor([0, 1]))
    assert pop.shape == (2, 6) and pop[0].tolist() == [1, 1, 1, 0, 0, 0]
    with pytest.raises(ValueError, match=r"score_fn returned shape \(2, 5\)"):
        evaluate_topk(lambda users: torch.zeros(len(users), 5), split, k=2)
