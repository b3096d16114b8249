"""Metrics: the Fréchet distance against closed forms, accuracy, and PNG grids."""

from __future__ import annotations

import pytest
import torch

from slipstream.diffusion import class_accuracy, frechet_distance, image_grid, save_image_grid


def test_frechet_distance_matches_the_closed_form_for_gaussians() -> None:
    """FD of N(m1, diag(a)) and N(m2, diag(b)) is |m1-m2|^2 + sum (sqrt a - sqrt b)^2."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(200000, 3, generator=gen, dtype=torch.float64) * torch.tensor([1.0, 2.0, 0.5])
    b = torch.randn(200000, 3, generator=gen, dtype=torch.float64) * torch.tensor([1.0, 1.0, 1.0])
    b = b + torch.tensor([1.0, 0.0, 0.0])
    expected = 1.0 + (2.0 - 1.0) ** 2 + (0.5 - 1.0) ** 2
    assert frechet_distance(a, b) == pytest.approx(expected, rel=0.02)
    assert frechet_distance(a, a) == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="same D"):
        frechet_distance(a, b[:, :2])


def test_class_accuracy_counts_argmax_hits() -> None:
    """A fixed linear 'classifier' scores the fraction of rows whose argmax equals the label."""
    clf = torch.nn.Identity()
    logits = torch.tensor([[2.0, 1.0], [0.0, 3.0], [5.0, 0.0], [1.0, 0.0]])
    assert class_accuracy(clf, logits, torch.tensor([0, 1, 1, 1])) == 0.5
    with pytest.raises(ValueError, match="same length"):
        class_accuracy(clf, logits, torch.tensor([0]))


def test_png_grid_round_trips(tmp_path) -> None:
    """A grid of 3 images (2 per row, scale 2, 1-px padding) has the right size and pixel values."""
    pil = pytest.importorskip("PIL.Image")
    imgs = torch.stack([torch.full((1, 4, 4), v) for v in (-1.0, 0.0, 1.0)])
    grid = image_grid(imgs, nrow=2, scale=2)
    assert grid.shape == (2 * 9 + 1, 2 * 9 + 1, 1)
    assert grid[1, 1, 0] == 0 and grid[1, 10, 0] == 128 and grid[10, 1, 0] == 255
    path = save_image_grid(imgs, tmp_path / "g.png", nrow=2, scale=2)
    assert pil.open(path).size == (19, 19)
