"""Segmentation loss and metric used with APF (arXiv 2404.09707 sec. IV; authors' release).

Loss on serialized (token) masks: ``bce_weight * BCE + (1 - bce_weight) * soft-Dice`` with
soft-Dice ``1 - (2 sum(p t) + 1) / (sum(p) + sum(t) + 1)`` per image, padding tokens excluded.
The metric is the hard Dice ``2 |A n B| / (|A| + |B|)`` at full resolution.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["bce_dice_loss", "dice_score", "soft_dice_loss"]


def _weights(logits: Tensor, valid: Tensor | None) -> Tensor:
    if valid is None:
        return torch.ones_like(logits)
    if valid.shape != logits.shape[:2]:
        raise ValueError(
            f"valid has shape {tuple(valid.shape)} but logits are {tuple(logits.shape)}; "
            "valid must be (batch, L) like the first two logits axes"
        )
    return valid[..., None, None].to(logits.dtype).expand_as(logits)


def soft_dice_loss(logits: Tensor, targets: Tensor, valid: Tensor | None = None) -> Tensor:
    """Mean over images of 1 - soft Dice between sigmoid(logits) and targets, (B, L, P, P)."""
    w = _weights(logits, valid)
    p = torch.sigmoid(logits) * w
    t = targets.to(logits.dtype) * w
    dims = tuple(range(1, logits.dim()))
    dice = (2 * (p * t).sum(dims) + 1) / (p.sum(dims) + t.sum(dims) + 1)
    return (1 - dice).mean()


def bce_dice_loss(
    logits: Tensor, targets: Tensor, valid: Tensor | None = None, bce_weight: float = 0.5
) -> Tensor:
    """``bce_weight * BCE + (1 - bce_weight) * soft-Dice`` over valid tokens (authors: 0.5).

    Args:
        logits, targets: (B, L, P, P); targets in [0, 1] (soft targets allowed).
        valid: (B, L) bool, False for padding tokens (excluded from both terms).
    """
    if logits.shape != targets.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} differ in shape"
        )
    w = _weights(logits, valid)
    bce = F.binary_cross_entropy_with_logits(
        logits, targets.to(logits.dtype), weight=w, reduction="sum"
    )
    bce = bce / w.sum().clamp(min=1)
    return bce_weight * bce + (1 - bce_weight) * soft_dice_loss(logits, targets, valid)


def dice_score(pred: Tensor, target: Tensor) -> Tensor:
    """(B,) hard Dice of boolean masks (B, H, W); 1.0 where both are empty."""
    p, t = pred.bool().flatten(1), target.bool().flatten(1)
    inter = (p & t).sum(1).double()
    total = p.sum(1).double() + t.sum(1).double()
    return torch.where(total > 0, 2 * inter / total.clamp(min=1), torch.ones_like(total))
