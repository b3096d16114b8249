"""Judging generated samples: class accuracy, an FID-style feature distance, PNG grids.

The Fréchet distance follows FID (Heusel et al. 2017, §3): fit Gaussians to the features of two
image sets and compute ``|mu_a - mu_b|^2 + Tr(S_a + S_b - 2 (S_a^1/2 S_b S_a^1/2)^1/2)``. With
digits the features are the 128-d penultimate layer of
:class:`~slipstream.diffusion.digits.DigitClassifier` instead of Inception's, so values are only
comparable between runs that use the same classifier.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

__all__ = [
    "class_accuracy",
    "frechet_distance",
    "image_grid",
    "mean_pairwise_distance",
    "sample_features",
    "save_image_grid",
]


@torch.no_grad()
def _batched(fn: nn.Module | object, x: torch.Tensor, batch: int) -> torch.Tensor:
    return torch.cat([fn(x[i : i + batch]) for i in range(0, len(x), batch)])  # type: ignore[operator]


@torch.no_grad()
def class_accuracy(
    classifier: nn.Module, images: torch.Tensor, labels: torch.Tensor, batch: int = 512
) -> float:
    """Fraction of ``images`` that ``classifier`` assigns to ``labels`` (in ``[0, 1]``)."""
    if len(images) != len(labels) or len(images) == 0:
        raise ValueError(
            f"images and labels must be non-empty and of the same length, got {len(images)} "
            f"and {len(labels)}"
        )
    preds = _batched(classifier, images, batch).argmax(dim=-1)
    return float((preds == labels.to(preds.device)).float().mean())


@torch.no_grad()
def sample_features(classifier: nn.Module, images: torch.Tensor, batch: int = 512) -> torch.Tensor:
    """``classifier.features`` of ``images`` in batches, as float64."""
    features = getattr(classifier, "features", None)
    if features is None:
        raise TypeError(f"{type(classifier).__name__} has no features(x) method for FID features")
    return _batched(features, images, batch).double()


def _sqrtm_psd(m: torch.Tensor) -> torch.Tensor:
    vals, vecs = torch.linalg.eigh((m + m.T) / 2)
    return (vecs * vals.clamp(min=0).sqrt()) @ vecs.T


def frechet_distance(features_a: torch.Tensor, features_b: torch.Tensor) -> float:
    """Fréchet distance between Gaussians fitted to two ``(N, D)`` feature sets (FID's formula).

    Raises:
        ValueError: the sets are not 2-D with the same ``D``, or have fewer than 2 rows.
    """
    if features_a.dim() != 2 or features_b.dim() != 2 or features_a.shape[1] != features_b.shape[1]:
        raise ValueError(
            f"features must be (N, D) with the same D, got {tuple(features_a.shape)} and "
            f"{tuple(features_b.shape)}"
        )
    if min(len(features_a), len(features_b)) < 2:
        raise ValueError("each feature set needs at least 2 rows to estimate a covariance")
    a, b = features_a.double(), features_b.double()
    mu_a, mu_b = a.mean(0), b.mean(0)
    cov_a, cov_b = torch.cov(a.T), torch.cov(b.T)
    root_a = _sqrtm_psd(cov_a)
    cross = _sqrtm_psd(root_a @ cov_b @ root_a)
    value = (mu_a - mu_b).pow(2).sum() + torch.trace(cov_a + cov_b - 2 * cross)
    return float(value.clamp(min=0))


def mean_pairwise_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean L2 distance between corresponding rows of ``a`` and ``b`` (same-noise deviation)."""
    if a.shape != b.shape:
        raise ValueError(
            f"a and b must have the same shape, got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    return float((a - b).flatten(1).norm(dim=1).mean())


def image_grid(images: torch.Tensor, nrow: int, scale: int = 1, pad: int = 1) -> torch.Tensor:
    """Tile ``(N, 1|3, H, W)`` images in ``[-1, 1]`` into one ``uint8`` ``(H', W', C)`` grid."""
    if images.dim() != 4 or images.shape[1] not in (1, 3):
        raise ValueError(f"images must be (N, 1 or 3, H, W), got {tuple(images.shape)}")
    n, c, h, w = images.shape
    img = ((images.detach().float().cpu().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    img = img.repeat_interleave(scale, dim=2).repeat_interleave(scale, dim=3)
    h, w = h * scale, w * scale
    rows = -(-n // nrow)
    grid = torch.full((c, rows * (h + pad) + pad, nrow * (w + pad) + pad), 255, dtype=torch.uint8)
    for k in range(n):
        r, q = divmod(k, nrow)
        grid[
            :,
            pad + r * (h + pad) : pad + r * (h + pad) + h,
            pad + q * (w + pad) : pad + q * (w + pad) + w,
        ] = img[k]
    return grid.permute(1, 2, 0)


def save_image_grid(images: torch.Tensor, path: str | Path, nrow: int = 10, scale: int = 2) -> Path:
    """Save :func:`image_grid` of ``images`` as a PNG at ``path`` (needs Pillow); returns the path."""
    try:
        from PIL import Image
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("saving PNG grids needs Pillow: pip install pillow") from err
    grid = image_grid(images, nrow, scale).numpy()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(grid[..., 0] if grid.shape[-1] == 1 else grid).save(path)
    return path
