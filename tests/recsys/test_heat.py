"""Tests for the HEAT trainer (slipstream/recsys/heat.py and its two backends)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from slipstream.recsys import (
    HEATConfig,
    HEATTrainer,
    SimpleX,
    SimpleXConfig,
    evaluate_topk,
    numba_available,
    popularity_scores,
    synthetic_interactions,
    user_history,
)

BACKENDS = [
    pytest.param("numba", marks=pytest.mark.skipif(not numba_available(), reason="no numba")),
    "torch",
]
SPLIT = synthetic_interactions(40, 50, 600, num_clusters=2, seed=2)


def _model(gate: float, dtype: torch.dtype = torch.float32, **kw: object) -> SimpleX:
    cfg = SimpleXConfig(embedding_dim=8, num_negatives=6, margin=0.2, gate=gate, max_history=10,
                        l2=1e-3, init_std=0.5, **kw)  # fmt: skip
    history = user_history(SPLIT.train, SPLIT.num_users, 10)
    return SimpleX(SPLIT.num_users, SPLIT.num_items, history, cfg, seed=3).to(dtype)


def _batch(n: int = 24) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    pairs = torch.from_numpy(SPLIT.train[:n])
    negs = torch.randint(0, SPLIT.num_items, (n, 6), generator=torch.Generator().manual_seed(5))
    negs[0, :2] = pairs[0, 1]  # a negative equal to the positive, and a repeated negative
    return pairs[:, 0], pairs[:, 1], negs


def _autograd(model: SimpleX, batch) -> dict[str, torch.Tensor]:
    model.zero_grad()
    model.loss(*batch).backward()
    return {
        n: p.grad if p.grad is not None else torch.zeros_like(p)
        for n, p in model.named_parameters()
    }


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("gate", [0.4, 1.0])
def test_gradients_equal_autograd(backend: str, gate: float) -> None:
    """Closed-form HEAT gradients (reused dot products, margin indicator) equal autograd:
    to 1e-6 in fp32 (numba; one compile keeps CI fast) and to 1e-9 relative in fp64 (torch)."""
    dtype = torch.float32 if backend == "numba" else torch.float64
    model, batch = _model(gate, dtype), _batch()
    with torch.no_grad():  # the margin indicator must be exercised both ways
        h = torch.nn.functional.normalize(model.user_vectors(batch[0]), dim=-1)
        cos = (
            h.unsqueeze(1) * torch.nn.functional.normalize(model.item_emb[batch[2]], dim=-1)
        ).sum(-1)
    assert (cos > 0.2).any() and (cos <= 0.2).any() and ((cos - 0.2).abs() > 1e-3).all()
    ours = HEATTrainer(model, SPLIT.train, HEATConfig(backend=backend)).gradients(*batch)
    ref = _autograd(model, batch)
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-9, "atol": 1e-12}
    for name in ("user_emb", "item_emb", "W"):
        torch.testing.assert_close(ours[name], ref[name], **tol, msg=name)


def test_printed_sign_of_heat_eq5_is_wrong() -> None:
    """d cos(h,v)/dv = (h|v|² - v(h·v)) / (|v|³|h|) as autograd says; the printed eq. 5 is its negative."""
    h, v = (
        torch.randn(5, dtype=torch.float64),
        torch.randn(5, dtype=torch.float64, requires_grad=True),
    )
    torch.nn.functional.cosine_similarity(h, v, dim=0).backward()
    b, c = (v * v).sum().detach(), (h * v).sum().detach()
    ours = (h * b - v.detach() * c) / (b * b.sqrt() * h.norm())
    torch.testing.assert_close(ours, v.grad)
    assert not torch.allclose(-ours, v.grad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp32_vector_products_match_the_bmm_reference(backend: str) -> None:
    """In fp32 the HEAT loss and gradients equal the gather+normalise+bmm autograd path to 1e-6."""
    model, batch = _model(0.4, torch.float32), _batch()
    trainer = HEATTrainer(model, SPLIT.train, HEATConfig(backend=backend, lr=1e-30))
    ref = _autograd(model, batch)
    ours = trainer.gradients(*batch)
    for name in ref:
        torch.testing.assert_close(ours[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)
    torch.testing.assert_close(
        torch.tensor(trainer.step(*batch)), model.loss(*batch).detach(), rtol=1e-6, atol=1e-6
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("gate", [1.0, 0.4])
def test_sgd_step_touches_only_the_sample_rows(backend: str, gate: float) -> None:
    """One sample changes only rows {u, i+, negatives} (+ u's history when aggregating)."""
    model = _model(gate)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    u, i, negs = (t[3:4] for t in _batch())
    HEATTrainer(model, SPLIT.train, HEATConfig(backend=backend, lr=0.1)).step(u, i, negs)
    hist = model.hist_items[model.hist_indptr[int(u)] : model.hist_indptr[int(u) + 1]]
    items = {int(i), *negs[0].tolist(), *(hist.tolist() if gate < 1 else [])}
    changed_items = (model.item_emb != before["item_emb"]).any(1).nonzero().flatten().tolist()
    changed_users = (model.user_emb != before["user_emb"]).any(1).nonzero().flatten().tolist()
    assert set(changed_items) == items and changed_users == [int(u)]
    assert torch.equal(model.W, before["W"]) == (gate == 1.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_epoch_equals_sgd_on_the_gradient_for_one_sample(backend: str) -> None:
    """With lr η and a single sample, step() moves every parameter by exactly -η · gradient."""
    # no repeated negative: the numba kernel updates rows in place, so a row drawn twice in
    # one sample gets its second update from the already-updated row (lock-free semantics)
    model, batch = (
        _model(0.4),
        (torch.tensor([0]), torch.tensor([38]), torch.tensor([[4, 24, 35, 25, 30, 36]])),
    )
    trainer = HEATTrainer(
        model, SPLIT.train, HEATConfig(backend=backend, lr=0.05, w_sync_interval=1)
    )
    grads = trainer.gradients(*batch)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.step(*batch)
    for name, p in model.named_parameters():
        torch.testing.assert_close(
            p.detach(), before[name] - 0.05 * grads[name], rtol=1e-5, atol=1e-7, msg=name
        )


def test_w_sync_of_one_equals_immediate_updates() -> None:
    """Local W accumulation with m = 1 equals applying each sample's update immediately."""
    pytest.importorskip("numba")
    batch = _batch(8)
    synced = _model(0.4)
    HEATTrainer(synced, SPLIT.train, HEATConfig(lr=0.05, w_sync_interval=1)).step(*batch)
    one_by_one = _model(0.4)
    trainer = HEATTrainer(one_by_one, SPLIT.train, HEATConfig(lr=0.05, w_sync_interval=1000))
    for b in range(8):
        trainer.step(*(t[b : b + 1] for t in batch))
    for (name, a), b in zip(synced.named_parameters(), one_by_one.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_training_lowers_loss_and_recovers_planted_structure(backend: str) -> None:
    """fp32 epochs lower the loss and reach Recall@20 over twice popularity's on clustered data."""
    split = synthetic_interactions(200, 300, 6000, num_clusters=6, in_cluster=0.9, seed=0)
    cfg = SimpleXConfig(embedding_dim=32, num_negatives=20, max_history=30)
    model = SimpleX(split.num_users, split.num_items, user_history(split.train, 200, 30), cfg)
    threads = 2 if backend == "numba" else 1  # 2 Hogwild threads; torch stays on one core
    trainer = HEATTrainer(
        model, split.train, HEATConfig(backend=backend, lr=0.2, num_threads=threads)
    )
    losses = [trainer.train_epoch() for _ in range(8)]
    trainer.close()
    assert losses[-1] < losses[0] - 0.05 and all(np.isfinite(losses))
    recall = evaluate_topk(model.score_all, split)["recall"]
    popular = evaluate_topk(popularity_scores(split), split)["recall"]
    assert recall > 2.0 * popular, (recall, popular)


def test_errors_name_the_problem() -> None:
    """Bad sample shapes, ids and parameter dtypes are refused with the fix in the message."""
    trainer = HEATTrainer(_model(0.4), SPLIT.train, HEATConfig(backend="torch"))
    u, i, negs = _batch(4)
    with pytest.raises(ValueError, match=r"negs \[B, num_negatives=6\]"):
        trainer.gradients(u, i, negs[:, :3])
    with pytest.raises(ValueError, match=r"pos ids must be in \[0, 50\)"):
        trainer.step(u, i + 100, negs)
    with pytest.raises(ValueError, match=r"model\.float\(\)"):
        HEATTrainer(_model(0.4, torch.float16), SPLIT.train)
