"""The edge pixels of a batch of images, as the APF patcher needs them (steps 1-2 of the
Adaptive Patch Framework: grey -> Gaussian blur -> Canny, from ``slipstream.vision.canny``).

:func:`edge_points` is what the APF patcher runs: the same grey -> blur -> Canny, computed
over row strips that stay in cache, returning the edge pixels as sorted flat indices (no
full-resolution float plane, no dense edge map); identical output, several times faster at 8K.

Threshold units: intensities are on the 0-255 scale, so the APF defaults ``(100, 200)`` mean
what they mean for OpenCV's ``Canny`` on 8-bit images.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from slipstream.vision.canny import (
    _LUMA,
    _check_thresholds,
    _gaussian_taps,
    _grey_scale,
    _hysteresis_sparse,
    _magnitude,
    _non_maximum_suppression,
    _separable_valid,
    _sobel_valid,
    _sqrt_rn,
    _thresholds,
    canny,
    gaussian_blur,
    gaussian_kernel_sigma,
    to_grey,
)

__all__ = [
    "EdgeBackend",
    "canny",
    "edge_points",
    "edge_points_and_means",
    "gaussian_blur",
    "gaussian_kernel_sigma",
    "resolve_edge_backend",
    "to_grey",
]

logger = logging.getLogger(__name__)

EdgeBackend = Literal["auto", "torch", "numba"]


# ITU-R BT.601 luma weights (what OpenCV and scikit-image use for RGB -> grey).
def _reflect_index(lo: int, hi: int, n: int, device: torch.device) -> Tensor:
    """Rows lo..hi-1 of a plane of n rows, mirrored at the borders (``F.pad`` "reflect")."""
    i = torch.arange(lo, hi, device=device).abs()
    return torch.where(i >= n, 2 * (n - 1) - i, i)


def edge_points(
    images: Tensor,
    *,
    blur_kernel: int = 3,
    low: float = 100.0,
    high: float = 200.0,
    relative: bool = False,
    norm: Literal["l2", "l1"] = "l1",
    strip_rows: int | None = None,
    backend: EdgeBackend = "auto",
) -> Tensor:
    """Sorted flat indices into (B, H, W) of the APF edge map of (B, C, H, W) images.

    Exactly ``canny(gaussian_blur(to_grey(images).round(), kernel_size=blur_kernel), low,
    high, relative=relative, norm=norm).flatten().nonzero()``, computed in horizontal strips
    of ``strip_rows`` rows (default: about 2**18 pixels on CPU, 2**26 on GPU) with halo rows: grey, blur, Sobel,
    magnitude and non-maximum suppression of one strip stay in cache, and no full-resolution
    float plane is ever allocated (at 8K each such plane is 256 MB and every pass over it
    costs more than the arithmetic). Every pixel goes through the same operations as in the
    dense pipeline, so the result is identical (tested). Hysteresis then runs on the sparse
    edge candidates only. ``relative`` thresholds take one extra pass for the peak gradient.

    ``backend``: ``"numba"`` runs grey -> blur -> Sobel -> non-maximum suppression as one
    fused CPU loop per row (float32/float64/uint8 images; about 4x faster than the torch strips at
    8K on one core, see ``docs/apf.md``); ``"torch"`` is the strip pipeline above (any
    device); ``"auto"`` picks numba for CPU float32/float64/uint8 images when it is installed
    (``pip install numba``, part of the ``apps`` extra). Both give the same indices, bit for
    bit (tested), so the choice only changes speed. ``strip_rows`` is the band of rows one
    numba call (one thread) handles; bands run on ``torch.get_num_threads()`` threads.
    """
    _check_edge_args(images, blur_kernel, low, high, relative, norm)
    b, _, h, w = images.shape
    radius = (blur_kernel - 1) // 2
    dev = images.device
    dtype = images.dtype if images.is_floating_point() else torch.float32
    k = _grey_scale(images.dtype)
    if radius >= min(h, w) or min(h, w) < 3:  # the dense blur switches to replicate here
        grey = gaussian_blur(to_grey(images).round_(), kernel_size=blur_kernel)
        e = canny(grey, low, high, relative=relative, norm=norm)
        return e.reshape(-1).nonzero().squeeze(1)
    if resolve_edge_backend(backend, images) == "numba":
        return _edge_points_numba(
            images.detach(), radius, blur_kernel, low, high, relative, norm, strip_rows
        )[0]
    taps = (
        _gaussian_taps(gaussian_kernel_sigma(blur_kernel), radius, dtype, dev) if radius else None
    )
    squared = norm == "l2"

    def block(top: int, bottom: int) -> tuple[int, Tensor, Tensor, Tensor]:
        """Sobel and magnitude of rows [top - 1, bottom + 1) clipped to the image.

        Grey is written straight into a column-padded buffer and the blur straight into a
        row- and column-padded one, so the borders cost a few column copies, not a pad.
        """
        s0, s1 = max(top - 1, 0), min(bottom + 1, h)
        u0, u1 = max(s0 - 1, 0), min(s1 + 1, h)
        n_u = u1 - u0
        lo, hi = u0 - radius, u1 + radius
        src = (
            images[:, :, lo:hi]
            if lo >= 0 and hi <= h
            else images.index_select(2, _reflect_index(lo, hi, h, dev))
        )
        src = src if src.is_floating_point() else src.to(dtype)
        grey = torch.empty((b, hi - lo, w + 2 * radius), dtype=dtype, device=dev)
        inner = grey[:, :, radius : radius + w]
        if src.shape[1] == 1:
            torch.mul(src[:, 0], k, out=inner)
        else:
            torch.mul(src[:, 0], _LUMA[0] * k, out=inner)
            inner.add_(src[:, 1], alpha=_LUMA[1] * k)
            inner.add_(src[:, 2], alpha=_LUMA[2] * k)
        inner.round_()
        for j in range(radius):  # reflect the columns (F.pad "reflect")
            grey[:, :, j] = grey[:, :, 2 * radius - j]
            grey[:, :, radius + w + j] = grey[:, :, radius + w - 2 - j]
        padded = torch.empty((b, s1 - s0 + 2, w + 2), dtype=dtype, device=dev)
        off = 1 if s0 == 0 else 0
        target = padded[:, off : off + n_u, 1 : w + 1]
        if taps is not None:
            _separable_valid(grey, taps, out=target)
        else:
            target.copy_(grey)
        if off:  # replicate the first / last row and the border columns (F.pad "replicate")
            padded[:, 0] = padded[:, 1]
        if s1 == h:
            padded[:, -1] = padded[:, -2]
        padded[:, :, 0] = padded[:, :, 1]
        padded[:, :, -1] = padded[:, :, -2]
        isobel, jsobel = _sobel_valid(padded)
        return s0, isobel, jsobel, _magnitude(isobel, jsobel, squared)

    # CPU: strips of about 2**18 pixels (all images together) stay in cache. GPU: one strip
    # per 2**26 pixels (an 8K image in one go): kernels stream at full bandwidth and each
    # strip costs synchronisations.
    budget = 1 << 18 if images.device.type == "cpu" else 1 << 26
    step = strip_rows or max(8, budget // max(w * b, 1))
    peak = None
    if relative:
        peak = torch.zeros(b, dtype=dtype, device=dev)
        for top in range(0, h, step):
            s0, _, _, score = block(top, min(top + step, h))
            own = score[:, top - s0 : min(top + step, h) - s0]
            peak = torch.maximum(peak, own.reshape(b, -1).amax(dim=1))
        peak = _sqrt_rn(peak) if squared else peak
    lo_t, hi_t = _thresholds(peak, low, high, b, torch.empty(0, dtype=dtype, device=dev))
    bound = (lo_t * lo_t if squared else lo_t) * (1 - 1e-5)
    found, strong_parts = [], []
    for top in range(0, h, step):
        bottom = min(top + step, h)
        s0, isobel, jsobel, score = block(top, bottom)
        n_rows = score.shape[1]
        cand = torch.zeros_like(score, dtype=torch.bool)
        lo_r, hi_r = max(top, 1) - s0, min(bottom, h - 1) - s0
        if hi_r > lo_r:
            cand[:, lo_r:hi_r, 1:-1] = score[:, lo_r:hi_r, 1:-1] >= bound.view(b, 1, 1)
        idx, mag = _non_maximum_suppression(isobel, jsobel, score, cand, lo_t, squared)
        img = idx // (n_rows * w)
        strong_parts.append(mag >= hi_t[img])
        found.append(img * (h * w) + (idx - img * (n_rows * w)) + s0 * w)
    idx = torch.cat(found)
    strong = torch.cat(strong_parts)
    if b > 1:  # strips hold every image, so sort into (image, row, column) order
        idx, order = idx.sort()
        strong = strong[order]
    return _hysteresis_sparse(idx, strong, w)


_NUMBA_DTYPES = (torch.float32, torch.float64, torch.uint8)
_warned_no_numba = False


def _check_edge_args(
    images: Tensor, blur_kernel: int, low: float, high: float, relative: bool, norm: str
) -> None:
    _check_thresholds(low, high, relative, norm)
    if images.dim() != 4 or images.shape[1] not in (1, 3, 4):
        to_grey(images)  # raises the shape error
    if blur_kernel < 1 or blur_kernel % 2 == 0:
        raise ValueError(f"blur_kernel={blur_kernel} must be odd and >= 1 (1 = no blur)")


def means_misfit(images: Tensor, factor: int, blur_kernel: int) -> str | None:
    """Why :func:`edge_points_and_means` cannot pool (B, C, H, W) ``images`` at ``factor``
    (the fix included), or None when it can."""
    _, _, h, w = images.shape
    if factor < 2 or factor & (factor - 1) or h % factor or w % factor:
        return f"factor={factor} must be a power of two >= 2 dividing the image sides {h} x {w}"
    if images.device.type != "cpu" or images.dtype not in (torch.float32, torch.uint8):
        return (
            f"edge_points_and_means takes float32 or uint8 CPU images, got {images.dtype} on "
            f"{images.device}; use edge_points and extract_tokens there"
        )
    if (blur_kernel - 1) // 2 >= min(h, w) or min(h, w) < 3:
        return (
            f"images of {h} x {w} are too small for the fused kernel with blur_kernel="
            f"{blur_kernel}; use edge_points"
        )
    return None


def edge_points_and_means(
    images: Tensor,
    factor: int,
    *,
    blur_kernel: int = 3,
    low: float = 100.0,
    high: float = 200.0,
    relative: bool = False,
    norm: Literal["l2", "l1"] = "l1",
    strip_rows: int | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`edge_points` (numba backend) and the ``factor`` x ``factor`` means of ``images``,
    from one pass over the image.

    The tokens of a quadtree are box means of the image, so the patcher would otherwise read
    the whole image a second time after the edges (at 8K a float32 RGB image is 805 MB, and
    that pass costs as much as half the edge kernel). Here every row is added into the means
    while the edge kernel has it in cache.

    Returns:
        (points, means): the edge pixels as :func:`edge_points` gives them, and (B, C, H / f,
        W / f) float32 means in the images' units (0-255 for uint8). Sums run down f rows,
        then along f columns: exact for uint8; for floats equal to ``avg_pool2d`` up to
        float32 rounding (a different summation order).

    Raises:
        ValueError: ``factor`` is not a power of two >= 2 dividing both sides, the images are
            not float32/uint8 on the CPU, or too small for the kernel (sides < 3 or < the blur).
        ImportError: numba is not installed.
    """
    _check_edge_args(images, blur_kernel, low, high, relative, norm)
    misfit = means_misfit(images, factor, blur_kernel)
    if misfit:
        raise ValueError(misfit)
    resolve_edge_backend("numba", images)  # ImportError naming the fix without numba
    radius = (blur_kernel - 1) // 2
    points, means = _edge_points_numba(
        images.detach(), radius, blur_kernel, low, high, relative, norm, strip_rows, factor
    )
    assert means is not None
    return points, means


@functools.cache
def _numba_installed() -> bool:
    return importlib.util.find_spec("numba") is not None


def _check_backend(backend: str) -> None:
    if backend not in ("auto", "torch", "numba"):
        raise ValueError(f"backend={backend!r} is unknown; use 'auto', 'torch' or 'numba'")


def numba_allowed(backend: str) -> bool:
    """Whether ``backend`` (an ``APFConfig.backend``) lets APF run its numba CPU kernels.

    ``"torch"``: never; ``"numba"``: yes, and numba must be installed; ``"auto"``: when numba
    is installed (logging once when it is not). Each caller still checks that its inputs fit.

    Raises:
        ValueError: ``backend`` is not one of "auto", "torch", "numba".
        ImportError: "numba" was asked for and numba is not installed.
    """
    global _warned_no_numba
    _check_backend(backend)
    if backend == "torch":
        return False
    if _numba_installed():
        return True
    if backend == "numba":
        raise ImportError(
            "backend 'numba' needs numba, which is not installed; `pip install numba` "
            "(or slipstream[apps]) or use backend='torch'"
        )
    if not _warned_no_numba:
        logger.warning(
            "APF: numba is not installed, so the CPU kernels fall back to the torch pipeline "
            "(same edges, several times slower at high resolution); `pip install numba`"
        )
        _warned_no_numba = True
    return False


def resolve_edge_backend(backend: str, images: Tensor) -> str:
    """The edge backend ``edge_points`` uses for ``images``: ``"torch"`` or ``"numba"``.

    Raises:
        ValueError: ``backend`` is not one of "auto", "torch", "numba", or "numba" was asked
            for images it cannot take (not on the CPU, or not float32/float64/uint8).
        ImportError: "numba" was asked for and numba is not installed.
    """
    _check_backend(backend)
    fits = images.device.type == "cpu" and images.dtype in _NUMBA_DTYPES
    if backend == "numba" and not fits:
        raise ValueError(
            f"the numba edge backend takes float32/float64/uint8 CPU images, got "
            f"{images.dtype} on {images.device}; use backend='torch' (any device or dtype) "
            "or 'auto'"
        )
    return "numba" if fits and numba_allowed(backend) else "torch"


def _edge_points_numba(
    images: Tensor,
    radius: int,
    blur_kernel: int,
    low: float,
    high: float,
    relative: bool,
    norm: str,
    band_rows: int | None,
    means: int = 0,
) -> tuple[Tensor, Tensor | None]:
    """``edge_points`` through the fused numba kernels, band by band (threads over bands);
    with ``means`` = f > 0 also the (B, C, H / f, W / f) float32 f x f means of ``images``."""
    from slipstream.vision import _numba_kernels as kernels

    b, c, h, w = images.shape
    dtype = images.dtype if images.is_floating_point() else torch.float32  # compute dtype
    x = images.contiguous().numpy()
    np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
    unit = _grey_scale(images.dtype)
    scale = (unit,) if c == 1 else tuple(v * unit for v in _LUMA)
    luma = np.array(scale, dtype=np_dtype)  # the same float rounding as torch's scalar casts
    taps = (
        _gaussian_taps(gaussian_kernel_sigma(blur_kernel), radius, dtype, images.device).numpy()
        if radius
        else np.ones(1, dtype=np_dtype)
    )
    squared = norm == "l2"
    step = band_rows or 512
    coarse = None
    if means:  # bands start on multiples of f, so each band pools whole groups of f rows
        step = max(means, step // means * means)
        coarse = np.empty((b, c, h // means, w // means), np.float32)
    bands = [(i, top, min(top + step, h)) for i in range(b) for top in range(0, h, step)]
    threads = min(torch.get_num_threads(), len(bands))
    pool = ThreadPoolExecutor(threads) if threads > 1 else None

    def run(fn, jobs):  # type: ignore[no-untyped-def]
        return list(pool.map(lambda a: fn(*a), jobs)) if pool else [fn(*a) for a in jobs]

    try:
        peak = None
        if relative:
            tops = run(lambda i, t, e: kernels.band_peak(x[i], luma, taps, t, e, squared), bands)
            per_image = [max(v for (i, _, _), v in zip(bands, tops) if i == k) for k in range(b)]
            peak = torch.tensor(per_image, dtype=dtype)
            peak = _sqrt_rn(peak) if squared else peak
        lo_t, hi_t = _thresholds(peak, low, high, b, torch.empty(0, dtype=dtype))
        bound = (lo_t * lo_t if squared else lo_t) * (1 - 1e-5)
        th = torch.stack([bound, lo_t, hi_t, torch.ones_like(lo_t)], 1).numpy()
        parts = run(
            lambda i, t, e: kernels.band_edges(
                x[i], luma, taps, t, e, th[i], squared, None if coarse is None else coarse[i]
            ),
            bands,
        )
    finally:
        if pool:
            pool.shutdown()
    idx = np.concatenate([p[0] + i * (h * w) for (i, _, _), p in zip(bands, parts)])
    strong = np.concatenate([p[1] for p in parts])
    points = torch.from_numpy(kernels.hysteresis(idx, strong, w))
    return points, None if coarse is None else torch.from_numpy(coarse)
