"""Loss and metric: soft-Dice / BCE formulas, padding exclusion, hard Dice."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slipstream.vision import bce_dice_loss, dice_score, soft_dice_loss


def test_soft_dice_formula_and_bce_mix() -> None:
    """soft-Dice = 1 - (2 sum(pt) + 1) / (sum(p) + sum(t) + 1); the loss mixes it 50/50 with BCE."""
    logits = torch.randn(2, 5, 4, 4)
    targets = (torch.rand(2, 5, 4, 4) > 0.5).float()
    p = logits.sigmoid()
    ref = (
        1 - (2 * (p * targets).sum((1, 2, 3)) + 1) / (p.sum((1, 2, 3)) + targets.sum((1, 2, 3)) + 1)
    ).mean()
    torch.testing.assert_close(soft_dice_loss(logits, targets), ref)
    bce = F.binary_cross_entropy_with_logits(logits, targets)
    torch.testing.assert_close(bce_dice_loss(logits, targets), 0.5 * bce + 0.5 * ref)


def test_padding_tokens_are_excluded_from_the_loss() -> None:
    """Whatever the logits/targets at padding, the loss equals the loss over valid tokens only."""
    logits, targets = torch.randn(1, 6, 2, 2), torch.rand(1, 6, 2, 2)
    valid = torch.tensor([[True, True, True, True, False, False]])
    other = logits.clone()
    other[:, 4:] = 100.0
    a = bce_dice_loss(logits, targets, valid)
    assert torch.allclose(a, bce_dice_loss(other, targets, valid))
    assert torch.allclose(a, bce_dice_loss(logits[:, :4], targets[:, :4]))


def test_hard_dice() -> None:
    """Dice = 2|A n B| / (|A| + |B|), 1 for two empty masks."""
    a = torch.zeros(2, 4, 4, dtype=torch.bool)
    b = torch.zeros(2, 4, 4, dtype=torch.bool)
    a[0, :2], b[0, 1:3] = True, True
    assert dice_score(a, b).tolist() == [0.5, 1.0]
