"""Offline segmentation data for APF: scikit-image's bundled images and exact synthetic masks.

Nothing here downloads. Bundled images (``camera``, ``coins``, ``immunohistochemistry``,
``retina``, ``horse``, ...) ship inside the scikit-image wheel (optional dependency); the
synthetic generator needs only PyTorch and produces high-resolution images (1K-8K a side) with
pixel-exact masks, the stand-in for whole-slide pathology images (PAIP) used in the paper.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "bundled_image",
    "horse_mask",
    "ihc_dab_mask",
    "otsu_threshold",
    "resize_square",
    "rgb_to_hed",
    "synthetic_blobs",
    "tile",
]


# Images shipped inside the scikit-image wheel (loading them needs no network).
_BUNDLED = (
    "astronaut", "brick", "camera", "cat", "cell", "checkerboard", "chelsea", "clock",
    "coffee", "coins", "colorwheel", "grass", "gravel", "horse", "hubble_deep_field",
    "immunohistochemistry", "logo", "microaneurysms", "moon", "page", "retina", "rocket",
    "text",
)  # fmt: skip


def _skimage_data() -> Any:
    try:
        import skimage.data
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "bundled images come from scikit-image; install it with `pip install scikit-image`"
        ) from exc
    return skimage.data


def resize_square(
    images: Tensor,
    size: int,
    mode: Literal["auto", "area", "bilinear", "bicubic", "nearest"] = "auto",
) -> Tensor:
    """Resize (B, C, H, W) images (or masks as (B, 1, H, W)) to (B, C, size, size).

    ``"auto"``: area averaging when shrinking, bilinear when growing. Aspect ratio is not
    kept (crop first with :func:`tile` to keep it). Bicubic output is clamped to the input
    range. For large upscaling prefer bicubic: bilinear gradients jump on the source pixel
    grid, which Canny picks up as spurious edges.
    """
    if images.dim() != 4:
        raise ValueError(f"images must be (batch, channels, H, W), got {tuple(images.shape)}")
    x = images if images.is_floating_point() else images.float()
    if mode == "auto":
        mode = "area" if size <= min(x.shape[-2:]) else "bilinear"
    if mode in ("bilinear", "bicubic"):
        out = F.interpolate(x, size=(size, size), mode=mode, align_corners=False)
        return out.clamp(x.min(), x.max()) if mode == "bicubic" else out
    if mode not in ("area", "nearest"):
        raise ValueError(
            f"mode={mode!r} is not one of 'auto', 'area', 'bilinear', 'bicubic', 'nearest'"
        )
    return F.interpolate(x, size=(size, size), mode=mode)


def bundled_image(name: str, size: int | None = None) -> Tensor:
    """A scikit-image bundled image as a (1, C, H, W) float tensor in [0, 1].

    ``size`` resizes to a ``size`` x ``size`` square (see :func:`resize_square`).

    Raises:
        ImportError: scikit-image is not installed.
        ValueError: ``name`` is not a bundled image of ``skimage.data``.
    """
    if name not in _BUNDLED:
        raise ValueError(
            f"{name!r} is not an image bundled with scikit-image (others are downloaded, and "
            f"this module never downloads); use one of: {', '.join(_BUNDLED)}"
        )
    arr = getattr(_skimage_data(), name)()
    t = torch.from_numpy(arr.copy())
    scale = (
        1.0
        if t.dtype == torch.bool
        else float(torch.iinfo(t.dtype).max)
        if not t.is_floating_point()
        else 1.0
    )
    t = t.float() / scale
    t = t.unsqueeze(0) if t.dim() == 2 else t[..., :3].permute(2, 0, 1)
    t = t.unsqueeze(0)
    return t if size is None else resize_square(t, size)


def horse_mask(size: int = 512) -> Tensor:
    """The bundled ``horse`` silhouette as a (1, size, size) bool mask (True on the horse)."""
    horse = ~torch.from_numpy(_skimage_data().horse())
    return resize_square(horse[None, None].float(), size, "nearest")[:, 0] > 0.5


# Ruifrok & Johnston (2001), "Quantification of histochemical staining by color
# deconvolution": optical-density vectors of haematoxylin, eosin and DAB.
_RGB_FROM_HED = ((0.65, 0.70, 0.29), (0.07, 0.99, 0.11), (0.27, 0.57, 0.78))


def rgb_to_hed(rgb: Tensor) -> Tensor:
    """Colour deconvolution of (B, 3, H, W) RGB in [0, 1] into H, E, DAB stain densities."""
    m = torch.tensor(_RGB_FROM_HED, dtype=torch.float64)
    hed_from_rgb = torch.linalg.inv(m).to(rgb.device, torch.float32)
    log_adjust = math.log(1e-6)
    od = torch.log(rgb.float().clamp(min=1e-6)) / log_adjust
    return torch.einsum("bchw,cs->bshw", od, hed_from_rgb).clamp(min=0)


def otsu_threshold(values: Tensor, bins: int = 256) -> Tensor:
    """Otsu's threshold per row of (B, N) values: maximises the between-class variance."""
    lo, hi = values.amin(1, keepdim=True), values.amax(1, keepdim=True)
    scaled = ((values - lo) / (hi - lo).clamp(min=1e-12) * (bins - 1)).round().long()
    hist = torch.zeros(values.shape[0], bins, device=values.device).scatter_add_(
        1, scaled, torch.ones_like(values, dtype=torch.float32)
    )
    p = hist / hist.sum(1, keepdim=True)
    centres = torch.arange(bins, device=values.device, dtype=torch.float32)
    w0 = p.cumsum(1)
    mu = (p * centres).cumsum(1)
    between = (mu[:, -1:] * w0 - mu) ** 2 / (w0 * (1 - w0)).clamp(min=1e-12)
    k = between.argmax(1, keepdim=True).float()
    return (lo + (k + 0.5) / (bins - 1) * (hi - lo)).squeeze(1)


def ihc_dab_mask(rgb: Tensor) -> Tensor:
    """Pseudo ground truth for IHC slides: Otsu-thresholded DAB (brown) stain, (B, H, W) bool."""
    dab = rgb_to_hed(rgb)[:, 2]
    t = otsu_threshold(dab.flatten(1))
    return dab > t.view(-1, 1, 1)


def _smooth_noise(shape: tuple[int, ...], sigma: float, g: torch.Generator) -> Tensor:
    x = torch.randn(shape, generator=g)
    radius = max(1, int(3 * sigma))
    t = torch.arange(-radius, radius + 1, dtype=torch.float32)
    k = torch.exp(-0.5 * (t / sigma) ** 2)
    k = k / k.sum()
    x = F.pad(x, (radius,) * 4, mode="circular")
    x = F.conv2d(x, k.view(1, 1, -1, 1))
    return F.conv2d(x, k.view(1, 1, 1, -1))


def synthetic_blobs(
    batch: int,
    size: int,
    *,
    seed: int = 0,
    blobs: float = 6.0,
    volume_fraction: float = 0.35,
    noise: float = 0.03,
    device: torch.device | str | None = None,
) -> tuple[Tensor, Tensor]:
    """High-resolution stained-tissue-like images with exact masks.

    A smooth random field (defined on a 128 x 128 grid, so the scene is the same at every
    resolution) is upsampled bicubically to ``size`` and thresholded at its
    ``1 - volume_fraction`` quantile: that is the mask, exact at full resolution. The image
    colours mask and background like an H&E slide, adds a smooth shading, a mid-frequency
    texture inside the tissue and per-pixel Gaussian noise of std ``noise``.

    Args:
        blobs: roughly how many blobs across the image (larger = smaller blobs).

    Returns:
        images (B, 3, size, size) float in [0, 1], masks (B, size, size) bool.
    """
    g = torch.Generator().manual_seed(seed)
    coarse = 128
    field = _smooth_noise((batch, 1, coarse, coarse), coarse / (2.5 * blobs), g)
    thresh = torch.quantile(field.flatten(1), 1 - volume_fraction, dim=1).view(-1, 1, 1, 1)
    shade = _smooth_noise((batch, 1, 16, 16), 2.0, g)
    texture = _smooth_noise((batch, 1, 256, 256), 1.5, g)
    dev = torch.device(device or "cpu")
    up = lambda t: F.interpolate(t.to(dev), size=(size, size), mode="bicubic", align_corners=False)  # noqa: E731
    mask = up(field) > thresh.to(dev)
    fg = torch.tensor([0.55, 0.25, 0.50], device=dev).view(1, 3, 1, 1)
    bg = torch.tensor([0.93, 0.88, 0.91], device=dev).view(1, 3, 1, 1)
    img = torch.where(mask, fg, bg)
    shade = up(shade)
    img = img + 0.04 * shade / shade.std().clamp(min=1e-6)
    tex = up(texture)
    img = img + mask * 0.05 * tex / tex.std().clamp(min=1e-6)
    gen = torch.Generator(device=dev).manual_seed(seed + 1)
    img = img + noise * torch.randn(img.shape, generator=gen, device=dev)
    return img.clamp(0, 1), mask[:, 0]


def tile(images: Tensor, tile_size: int) -> Tensor:
    """Cut (B, C, H, W) into non-overlapping (B * n, C, tile_size, tile_size) tiles (rest dropped)."""
    b, c, h, w = images.shape
    nh, nw = h // tile_size, w // tile_size
    if nh == 0 or nw == 0:
        raise ValueError(f"tile_size={tile_size} exceeds the image size {h} x {w}")
    x = images[:, :, : nh * tile_size, : nw * tile_size]
    x = x.reshape(b, c, nh, tile_size, nw, tile_size).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b * nh * nw, c, tile_size, tile_size)
