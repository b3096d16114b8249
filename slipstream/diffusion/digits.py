"""Offline data and judge for the diffusion examples: scikit-learn's bundled digits.

``sklearn.datasets.load_digits`` ships 1,797 handwritten digits as 8x8 images with 17 grey levels
inside the wheel (no download). They are upsampled bilinearly to ``image_size`` and scaled to
``[-1, 1]``, the range diffusion models are trained on. :class:`DigitClassifier` is a small CNN
that judges generated samples: its prediction gives the class accuracy of a conditional sampler
and its penultimate features feed the Fréchet distance (:mod:`slipstream.diffusion.metrics`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["DigitClassifier", "DigitsData", "load_digits_data"]

NUM_DIGIT_CLASSES = 10


@dataclass(frozen=True)
class DigitsData:
    """The digits split into a training and a held-out test set.

    Attributes:
        train_images: ``(N_train, 1, S, S)`` float32 in ``[-1, 1]``.
        train_labels: ``(N_train,)`` long in ``[0, 10)``.
        test_images: held-out images, same layout.
        test_labels: held-out labels.
    """

    train_images: torch.Tensor
    train_labels: torch.Tensor
    test_images: torch.Tensor
    test_labels: torch.Tensor


def load_digits_data(image_size: int = 16, test_fraction: float = 0.2, seed: int = 0) -> DigitsData:
    """Load scikit-learn's digits, upsampled to ``image_size``, with a stratified test split.

    Raises:
        ImportError: scikit-learn is not installed (``pip install scikit-learn``).
        ValueError: ``image_size < 8`` or ``test_fraction`` outside ``(0, 1)``.
    """
    if image_size < 8:
        raise ValueError(f"image_size must be >= 8 (the digits are 8x8), got {image_size}")
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the digits data set needs scikit-learn: pip install scikit-learn"
        ) from err
    bunch = load_digits()
    images = torch.tensor(bunch.images, dtype=torch.float32)[:, None] / 16.0
    if image_size != 8:
        images = F.interpolate(images, size=(image_size, image_size), mode="bilinear")
    images = (images * 2 - 1).clamp(-1, 1)
    labels = torch.tensor(bunch.target, dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    test_mask = torch.zeros(len(labels), dtype=torch.bool)
    for c in range(NUM_DIGIT_CLASSES):
        idx = (labels == c).nonzero().flatten()
        idx = idx[torch.randperm(len(idx), generator=gen)]
        test_mask[idx[: round(test_fraction * len(idx))]] = True
    return DigitsData(images[~test_mask], labels[~test_mask], images[test_mask], labels[test_mask])


class DigitClassifier(nn.Module):
    """A small CNN over ``(B, 1, S, S)`` digits in ``[-1, 1]``; ``features`` is its 128-d embedding."""

    def __init__(self, num_classes: int = NUM_DIGIT_CLASSES, width: int = 32) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(2 * width, 2 * width, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(2),
            nn.Flatten(),
            nn.Linear(8 * width, 128),
            nn.ReLU(),
        )
        self.head = nn.Linear(128, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The 128-d penultimate features (used for the Fréchet distance)."""
        if x.dim() != 4 or x.shape[1] != 1:
            raise ValueError(f"DigitClassifier input must be (B, 1, H, W), got {tuple(x.shape)}")
        return self.body(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits ``(B, num_classes)``."""
        return self.head(self.features(x))
