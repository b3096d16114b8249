"""SimpleX (Mao et al., CIKM 2021) in plain PyTorch: the autograd baseline and the
reference every fast path is checked against.

The forward is the straightforward one HEAT profiles (§3): gather the user's history
and the candidate items, concatenate, normalise, and score them with one ``bmm``.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from slipstream.recsys.config import SimpleXConfig

__all__ = ["COSINE_EPS", "SimpleX", "train_reference_epoch"]

COSINE_EPS = 1e-8
"""Norms are clamped below at this value inside the cosine (as ``F.normalize``)."""


class SimpleX(nn.Module):
    """User/item embeddings, behaviour aggregation and the cosine contrastive loss.

    Args:
        num_users: user ids are ``0..num_users-1``.
        num_items: item ids are ``0..num_items-1``.
        history: ``(indptr, items)`` CSR of each user's history
            (:func:`slipstream.recsys.data.user_history`); at most ``config.max_history``
            items per user are used.
        config: model and loss hyper-parameters.
        seed: seeds the initialisation.

    Parameters ``user_emb [U, K]``, ``item_emb [I, K]`` and ``W [K, K]`` are plain
    tensors the HEAT trainer updates in place; ``h_u = g e_u + (1 - g) p_u Wᵀ``.
    """

    def __init__(
        self,
        num_users: int,
        num_items: int,
        history: tuple[np.ndarray, np.ndarray],
        config: SimpleXConfig | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.config = config = config or SimpleXConfig()
        indptr, items = history
        if len(indptr) != num_users + 1:
            raise ValueError(
                f"history indptr has {len(indptr)} entries, expected num_users + 1 = "
                f"{num_users + 1}; build it with user_history(train, num_users, max_len)"
            )
        lengths = np.diff(indptr)
        if lengths.max(initial=0) > config.max_history:
            raise ValueError(
                f"a history has {int(lengths.max())} items > max_history={config.max_history}; "
                "build it with user_history(train, num_users, config.max_history)"
            )
        if len(items) and (items.min() < 0 or items.max() >= num_items):
            raise ValueError(f"history item ids must be in [0, {num_items}), got {items.max()}")
        self.num_users, self.num_items = num_users, num_items
        self.hist_indptr = np.ascontiguousarray(indptr, dtype=np.int64)
        self.hist_items = np.ascontiguousarray(items, dtype=np.int64)
        gen = torch.Generator().manual_seed(seed)
        k = config.embedding_dim
        self.user_emb = nn.Parameter(torch.randn(num_users, k, generator=gen) * config.init_std)
        self.item_emb = nn.Parameter(torch.randn(num_items, k, generator=gen) * config.init_std)
        self.W = nn.Parameter(torch.randn(k, k, generator=gen) * (2.0 / (k + k)) ** 0.5)
        # padded history for the batched reference: [U, L] ids and a [U, L] mask
        width = max(int(lengths.max(initial=0)), 1)
        pos = np.arange(len(items)) - np.repeat(indptr[:-1], lengths)
        pad = np.zeros((num_users, width), dtype=np.int64)
        mask = np.zeros((num_users, width), dtype=np.float32)
        rows = np.repeat(np.arange(num_users), lengths)
        pad[rows, pos], mask[rows, pos] = items, 1.0
        self.register_buffer("hist_pad", torch.from_numpy(pad), persistent=False)
        self.register_buffer("hist_mask", torch.from_numpy(mask), persistent=False)

    def user_vectors(self, users: torch.Tensor) -> torch.Tensor:
        """``h_u`` for a batch of user ids ``[B]`` -> ``[B, K]`` (SimpleX eq. 2, mean pooling)."""
        g = self.config.gate
        e_u = self.user_emb[users]
        if g == 1.0:
            return e_u
        mask = self.hist_mask[users].to(e_u.dtype)
        summed = (self.item_emb[self.hist_pad[users]] * mask.unsqueeze(-1)).sum(1)
        p_u = summed / mask.sum(1, keepdim=True).clamp_min(1.0)
        return g * e_u + (1.0 - g) * (p_u @ self.W.T)

    def loss(self, users: torch.Tensor, pos: torch.Tensor, negs: torch.Tensor) -> torch.Tensor:
        """Mean cosine contrastive loss (HEAT eq. 3) over ``B`` samples plus L2.

        Args:
            users, pos: ``[B]`` ids of the positive pairs.
            negs: ``[B, n]`` negative item ids.
        """
        cfg = self.config
        h = F.normalize(self.user_vectors(users), dim=-1, eps=COSINE_EPS)
        cand = torch.cat([pos.unsqueeze(1), negs], dim=1)
        e = self.item_emb[cand]
        scores = torch.bmm(F.normalize(e, dim=-1, eps=COSINE_EPS), h.unsqueeze(-1)).squeeze(-1)
        pos_term = 1.0 - scores[:, 0]
        neg_term = F.relu(scores[:, 1:] - cfg.margin).mean(1) * cfg.negative_weight
        reg = self.user_emb[users].pow(2).sum(1) + e.pow(2).sum((1, 2))
        return (pos_term + neg_term + cfg.l2 * reg).mean()

    @torch.no_grad()
    def score_all(self, users: torch.Tensor) -> torch.Tensor:
        """Cosine of ``h_u`` with every item: ``[b] -> [b, num_items]`` (for ranking)."""
        h = F.normalize(self.user_vectors(users), dim=-1, eps=COSINE_EPS)
        return h @ F.normalize(self.item_emb, dim=-1, eps=COSINE_EPS).T


def train_reference_epoch(
    model: SimpleX,
    train: np.ndarray,
    optimizer: torch.optim.Optimizer,
    batch_size: int = 1024,
    generator: torch.Generator | None = None,
) -> float:
    """One epoch of the plain PyTorch baseline: shuffled mini-batches, uniform negatives,
    autograd, ``optimizer.step()``. Returns the mean batch loss."""
    gen = generator or torch.Generator().manual_seed(0)
    pairs = torch.from_numpy(train)
    order = torch.randperm(len(pairs), generator=gen)
    n_neg = model.config.num_negatives
    total, steps = 0.0, 0
    for start in range(0, len(order), batch_size):
        batch = pairs[order[start : start + batch_size]]
        negs = torch.randint(0, model.num_items, (len(batch), n_neg), generator=gen)
        loss = model.loss(batch[:, 0], batch[:, 1], negs)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        total, steps = total + loss.item(), steps + 1
    return total / max(steps, 1)
