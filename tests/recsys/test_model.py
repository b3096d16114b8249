"""Tests for the reference SimpleX model and configs (slipstream/recsys/model.py, config.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from slipstream.config._errors import ConfigError
from slipstream.recsys import HEATConfig, SimpleX, SimpleXConfig, train_reference_epoch
from slipstream.recsys.data import synthetic_interactions, user_history


def _model(gate: float, **kw: object) -> tuple[SimpleX, np.ndarray]:
    split = synthetic_interactions(20, 30, 200, num_clusters=2, seed=1)
    cfg = SimpleXConfig(embedding_dim=6, num_negatives=4, gate=gate, max_history=5, **kw)
    history = user_history(split.train, 20, 5)
    return SimpleX(20, 30, history, cfg).double(), split.train


def test_loss_matches_the_formula_sample_by_sample() -> None:
    """loss() = mean over samples of (1-cos+) + w/n Σ relu(cos- - m) + l2 Σ|rows|², with h_u aggregated."""
    model, train = _model(0.3, margin=0.1, negative_weight=3.0, l2=1e-2)
    users, pos = torch.from_numpy(train[:5, 0]), torch.from_numpy(train[:5, 1])
    negs = torch.randint(0, 30, (5, 4), generator=torch.Generator().manual_seed(0))
    expected = []
    U, V, W = model.user_emb, model.item_emb, model.W
    for b in range(5):
        u = int(users[b])
        hist = model.hist_items[model.hist_indptr[u] : model.hist_indptr[u + 1]]
        h = 0.3 * U[u] + 0.7 * (W @ V[torch.from_numpy(hist)].mean(0))
        cos = [torch.dot(h, V[j]) / (h.norm() * V[j].norm()) for j in [int(pos[b]), *negs[b]]]
        term = 1 - cos[0] + 3.0 / 4 * sum(torch.relu(c - 0.1) for c in cos[1:])
        rows = [U[u], V[int(pos[b])], *(V[j] for j in negs[b])]
        expected.append(term + 1e-2 * sum(r.pow(2).sum() for r in rows))
    torch.testing.assert_close(model.loss(users, pos, negs), torch.stack(expected).mean())


def test_gate_one_is_mf_ccl() -> None:
    """With gate = 1 the user vector is the user embedding itself (MF-CCL)."""
    model, _ = _model(1.0)
    users = torch.arange(20)
    assert torch.equal(model.user_vectors(users), model.user_emb[users])


def test_reference_epoch_lowers_the_loss() -> None:
    """A few autograd epochs (Adam) lower the mean training loss."""
    model, train = _model(0.5)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    first = train_reference_epoch(model, train, opt, batch_size=32, generator=gen)
    for _ in range(4):
        last = train_reference_epoch(model, train, opt, batch_size=32, generator=gen)
    assert last < first - 0.02


def test_configs_reject_bad_values_naming_the_field() -> None:
    """Invalid hyper-parameters raise ConfigError naming the field, value and rule."""
    with pytest.raises(
        ConfigError, match=r"SimpleXConfig.gate=1.5 is invalid: it must be in \[0, 1\]"
    ):
        SimpleXConfig(gate=1.5)
    with pytest.raises(ConfigError, match=r"HEATConfig.backend='cuda'.*'numba', 'torch'"):
        HEATConfig(backend="cuda")
    with pytest.raises(ValueError, match="max_history=5"):
        history = (np.array([0, 6]), np.arange(6))
        SimpleX(1, 10, history, SimpleXConfig(max_history=5))
