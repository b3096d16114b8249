"""Grey conversion, Gaussian smoothing and a batched Canny edge detector in PyTorch.

Steps 1-2 of the Adaptive Patch Framework (APF, Zhang et al., SC24, arXiv 2404.09707,
sec. III-A: "Gaussian blur then Canny"). Everything is dense tensor arithmetic plus one sparse
connected-components pass, so it runs on CPU or GPU for any batch of images.

The detector follows Canny (1986) the way scikit-image's ``feature.canny`` does (tests compare
the two pixel by pixel): Gaussian smoothing with border renormalisation, 3x3 Sobel gradients,
non-maximum suppression with linear interpolation between the two neighbours along the
gradient, and hysteresis with 8-connectivity. The one-pixel image border is never an edge.

Threshold units: intensities are on the 0-255 scale, so the APF defaults ``(100, 200)`` mean
what they mean for OpenCV's ``Canny`` on 8-bit images. The strip-wise edge extraction the
patcher runs, and its numba backend, are in ``slipstream.vision.edges``.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["canny", "gaussian_blur", "gaussian_kernel_sigma", "to_grey"]

_LUMA = (0.299, 0.587, 0.114)


def _sqrt_rn(x: Tensor) -> Tensor:
    """The correctly rounded (IEEE 754) square root of ``x``, the same on every CPU.

    ``torch.sqrt`` on a CPU tensor of more than a few elements runs through MKL's vector math,
    which is accurate to about one ulp but not correctly rounded, and picks its code path by
    CPU vendor and tensor length: on an AMD EPYC 15% of float32 and 1% of float64 results are
    one ulp off, on the Intel CPUs measured none. The l2 edge pipeline compares interpolated
    magnitudes for equality, so one ulp decides whether a pixel is an edge. NumPy's sqrt is the
    IEEE instruction, as is CUDA's, so the torch and numba backends agree on any machine.
    """
    if x.device.type != "cpu":
        return x.sqrt()
    return torch.from_numpy(np.sqrt(x.detach().contiguous().numpy()))


def _grey_scale(dtype: torch.dtype) -> float:
    """Factor that puts pixel values of ``dtype`` on the 0-255 scale: floats are in [0, 1],
    integers in [0, max] (1.0 for uint8)."""
    if dtype.is_floating_point:
        return 255.0
    if dtype == torch.bool:
        raise ValueError("images are float in [0, 1] or integer (uint8 0-255), got bool")
    return 255.0 / torch.iinfo(dtype).max


def to_grey(images: Tensor) -> Tensor:
    """Convert ``images`` of shape (B, C, H, W) to (B, H, W) grey on the 0-255 scale.

    Float images are in [0, 1]; integer images in [0, dtype max] (uint8: 0-255, taken as is).
    C = 1 is taken as is; C = 3 uses BT.601 luma weights; C = 4 drops alpha.

    Raises:
        ValueError: ``images`` is not 4-D or has a channel count other than 1, 3 or 4.
    """
    if images.dim() != 4 or images.shape[1] not in (1, 3, 4):
        raise ValueError(
            f"images must have shape (batch, channels, height, width) with 1, 3 or 4 channels, "
            f"got {tuple(images.shape)}; add a batch axis with images.unsqueeze(0)"
        )
    k = _grey_scale(images.dtype)
    x = images.float() if not images.is_floating_point() else images
    if x.shape[1] == 1:
        return x[:, 0] * k
    # Three multiply-adds, not an einsum: one pass fewer, and every pixel gets the same
    # arithmetic whatever the tensor's shape (the strip-wise pipeline relies on that).
    grey = x[:, 0] * (_LUMA[0] * k)
    grey.add_(x[:, 1], alpha=_LUMA[1] * k)
    return grey.add_(x[:, 2], alpha=_LUMA[2] * k)


def gaussian_kernel_sigma(kernel_size: int) -> float:
    """OpenCV's sigma for a k x k Gaussian kernel: 0.3 * ((k - 1) / 2 - 1) + 0.8."""
    if kernel_size < 1 or kernel_size % 2 == 0:
        raise ValueError(
            f"kernel_size={kernel_size} must be a positive odd integer (1, 3, 5, 7, ...)"
        )
    return 0.3 * ((kernel_size - 1) / 2 - 1) + 0.8


def _gaussian_taps(sigma: float, radius: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    x = torch.arange(-radius, radius + 1, dtype=torch.float64)
    taps = torch.exp(-0.5 * (x / sigma) ** 2)
    return (taps / taps.sum()).to(dtype=dtype, device=device)


def _separable(x: Tensor, taps: Tensor, mode: str) -> Tensor:
    """Correlate each (H, W) plane of ``x`` (B, H, W) with ``taps`` along columns then rows.

    Shifted multiply-adds rather than ``conv2d``: a one-channel convolution is several times
    slower on CPU and this is memory-bound anyway.
    """
    r = (taps.numel() - 1) // 2
    p = (
        F.pad(x.unsqueeze(1), (r, r, r, r), mode=mode)[:, 0]
        if mode != "constant"
        else F.pad(x, (r, r, r, r))
    )
    return _separable_valid(p, taps)


def _separable_valid(p: Tensor, taps: Tensor, out: Tensor | None = None) -> Tensor:
    """The valid part of the separable correlation of already padded planes ``p``
    (written into ``out`` if given)."""
    t = taps.tolist()
    h, w = p.shape[-2] - len(t) + 1, p.shape[-1] - len(t) + 1
    rows = p[:, :, 0:w] * t[0]
    for k in range(1, len(t)):
        rows.add_(p[:, :, k : k + w], alpha=t[k])
    out = torch.mul(rows[:, 0:h], t[0], out=out) if out is not None else rows[:, 0:h] * t[0]
    for k in range(1, len(t)):
        out.add_(rows[:, k : k + h], alpha=t[k])
    return out


def gaussian_blur(
    grey: Tensor, *, sigma: float | None = None, kernel_size: int | None = None
) -> Tensor:
    """Blur (B, H, W) or (H, W) planes with a Gaussian, borders reflected (OpenCV style).

    Give ``kernel_size`` (odd, sigma from OpenCV's rule) or ``sigma`` (radius 4 sigma, as
    SciPy). ``kernel_size=1`` or ``sigma=0`` returns the input.
    """
    if (sigma is None) == (kernel_size is None):
        raise ValueError("gaussian_blur takes exactly one of sigma= or kernel_size=")
    if kernel_size is not None:
        if kernel_size == 1:
            return grey
        sigma = gaussian_kernel_sigma(kernel_size)
        radius = (kernel_size - 1) // 2
    else:
        assert sigma is not None
        if sigma < 0:
            raise ValueError(f"sigma={sigma} must be >= 0")
        if sigma == 0:
            return grey
        radius = int(4.0 * sigma + 0.5)
    taps = _gaussian_taps(sigma, radius, grey.dtype, grey.device)
    x = grey.unsqueeze(0) if grey.dim() == 2 else grey
    out = _separable(x, taps, "reflect" if min(x.shape[-2:]) > radius else "replicate")
    return out[0] if grey.dim() == 2 else out


def _smooth_renormalised(grey: Tensor, sigma: float) -> Tensor:
    """Zero-padded Gaussian divided by the Gaussian of ones (no darkening at the border)."""
    if sigma == 0:
        return grey
    radius = int(4.0 * sigma + 0.5)
    taps = _gaussian_taps(sigma, radius, grey.dtype, grey.device)
    ones = torch.ones_like(grey[:1])
    bleed = _separable(ones, taps, "constant") + torch.finfo(grey.dtype).eps
    return _separable(grey, taps, "constant") / bleed


def _sobel(x: Tensor) -> tuple[Tensor, Tensor]:
    """Unnormalised 3x3 Sobel derivatives along rows (i) and columns (j), replicate border."""
    return _sobel_valid(F.pad(x.unsqueeze(1), (1, 1, 1, 1), mode="replicate")[:, 0])


def _sobel_valid(p: Tensor) -> tuple[Tensor, Tensor]:
    """Sobel derivatives of the interior of already padded planes ``p`` (B, H + 2, W + 2)."""
    dj = p[:, :, 2:] - p[:, :, :-2]  # [-1, 0, 1] along columns
    di = p[:, 2:, :] - p[:, :-2, :]  # [-1, 0, 1] along rows
    jsobel = (dj[:, :-2] + dj[:, 2:]).add_(dj[:, 1:-1], alpha=2)
    del dj
    isobel = (di[:, :, :-2] + di[:, :, 2:]).add_(di[:, :, 1:-1], alpha=2)
    return isobel, jsobel


def _magnitude(isobel: Tensor, jsobel: Tensor, squared: bool) -> Tensor:
    """|gi| + |gj|, or gi**2 + gj**2 when ``squared`` (the l2 norm's square)."""
    if squared:
        score = isobel * isobel
        return score.addcmul_(jsobel, jsobel)
    return isobel.abs().add_(jsobel.abs())


def _non_maximum_suppression(
    isobel: Tensor,
    jsobel: Tensor,
    score: Tensor,
    candidates: Tensor,
    low: Tensor,
    squared: bool,
) -> tuple[Tensor, Tensor]:
    """Candidates >= ``low`` (per plane) that are maxima of the gradient magnitude along it.

    The gradient direction selects one axial neighbour (row or column step) and one diagonal
    neighbour on each side; the magnitude there is interpolated linearly with weight
    ``w = min(|gi|, |gj|) / max(|gi|, |gj|)``. A pixel survives when it is >= both
    interpolated values. Only candidate pixels are visited (sparse gathers of ``score``, the
    magnitude, or its square when ``squared``); candidates must exclude the one-pixel border
    so every neighbour index stays inside its plane.

    Returns:
        Flat indices of the surviving pixels (sorted) and their magnitudes.
    """
    height, width = score.shape[-2:]
    flat = score.reshape(-1)

    def mag_at(j: Tensor) -> Tensor:
        return _sqrt_rn(flat[j]) if squared else flat[j]

    idx = candidates.reshape(-1).nonzero().squeeze(1)
    m = mag_at(idx)
    keep = m >= low[idx // (height * width)]
    idx, m = idx[keep], m[keep]
    gi, gj = isobel.reshape(-1)[idx], jsobel.reshape(-1)[idx]
    same_sign = (gi > 0) == (gj > 0)
    ai, aj = gi.abs(), gj.abs()
    # Tie-breaking (|gi| == |gj|) follows scikit-image: the axial step is a column step when
    # the signs agree and a row step when they differ.
    row_axial = torch.where(same_sign, ai > aj, ai >= aj)
    w = torch.minimum(ai, aj) / torch.maximum(ai, aj)
    axial = torch.where(row_axial, torch.where(same_sign, width, -width), 1)
    diag = torch.where(same_sign, width + 1, 1 - width)

    plus = mag_at(idx + diag) * w + mag_at(idx + axial) * (1.0 - w) <= m
    minus = mag_at(idx - diag) * w + mag_at(idx - axial) * (1.0 - w) <= m
    peak = plus & minus
    return idx[peak], m[peak]


def _hysteresis_sparse(idx: Tensor, strong: Tensor, width: int) -> Tensor:
    """The pixels of ``idx`` whose 8-connected component holds a ``strong`` one.

    ``idx``: sorted flat indices of weak-edge pixels of (B, H, W) planes of row length
    ``width``, none on the one-pixel border; ``strong``: bool per entry of ``idx``.
    Neighbours are found by binary search in ``idx`` (no dense index map); connected
    components by root hooking plus pointer jumping (Shiloach-Vishkin style): O(log n) rounds
    of gathers and one ``scatter_reduce`` each, instead of a flood fill whose round count
    grows with the longest edge curve. Returns the kept indices (sorted).
    """
    n = idx.numel()
    if n == 0:
        return idx
    src, dst = [], []
    for off in (1, width - 1, width, width + 1):  # right, down-left, down, down-right
        target = idx + off
        pos = torch.searchsorted(idx, target).clamp_(max=n - 1)
        hit = idx[pos] == target
        src.append(hit.nonzero().squeeze(1))
        dst.append(pos[hit])
    u, v = torch.cat(src), torch.cat(dst)
    parent = torch.arange(n, device=idx.device)
    while True:
        pu, pv = parent[u], parent[v]
        differ = pu != pv
        if not bool(differ.any()):
            break
        pu, pv = pu[differ], pv[differ]
        parent.scatter_reduce_(0, torch.maximum(pu, pv), torch.minimum(pu, pv), reduce="amin")
        while True:  # pointer jumping until every tree is a star
            grand = parent[parent]
            if torch.equal(grand, parent):
                break
            parent = grand
    has_strong = torch.zeros(n, dtype=torch.bool, device=idx.device)
    has_strong[parent[strong]] = True  # (a bool scatter_reduce has no CUDA kernel)
    return idx[has_strong[parent]]


def _hysteresis(idx: Tensor, strong: Tensor, shape: torch.Size) -> Tensor:
    """Dense (B, H, W) bool map of :func:`_hysteresis_sparse` on planes of ``shape``."""
    b, h, w = shape
    out = torch.zeros(b * h * w, dtype=torch.bool, device=idx.device)
    out[_hysteresis_sparse(idx, strong, w)] = True
    return out.view(b, h, w)


def _check_thresholds(low: float, high: float, relative: bool, norm: str) -> None:
    if norm not in ("l2", "l1"):
        raise ValueError(f"norm={norm!r} is not a gradient norm; use 'l2' or 'l1'")
    if low > high:
        raise ValueError(f"canny low={low} must be <= high={high}; swap the two thresholds")
    if relative and not (0.0 < low <= 1.0 and 0.0 < high <= 1.0):
        raise ValueError(
            f"relative canny thresholds must lie in (0, 1], got low={low}, high={high}; "
            "pass relative=False for absolute 0-255 gradient thresholds"
        )


def _thresholds(
    peak: Tensor | None, low: float, high: float, b: int, like: Tensor
) -> tuple[Tensor, Tensor]:
    """Per-image (low, high) thresholds; ``peak`` (B,) is the largest magnitude if relative."""
    if peak is not None:
        lo_t, hi_t = low * peak, high * peak
    else:
        lo_t = torch.full((b,), low, dtype=like.dtype, device=like.device)
        hi_t = torch.full((b,), high, dtype=like.dtype, device=like.device)
    # A zero magnitude is never an edge, even with low == 0.
    return lo_t.clamp(min=1e-14 if like.dtype == torch.float64 else 1e-30), hi_t


def canny(
    grey: Tensor,
    low: float = 100.0,
    high: float = 200.0,
    *,
    sigma: float = 0.0,
    relative: bool = False,
    norm: Literal["l2", "l1"] = "l2",
) -> Tensor:
    """Binary Canny edge map of (B, H, W) grey planes (or one (H, W) plane).

    Args:
        grey: intensities on the 0-255 scale (see :func:`to_grey`), any float dtype.
        low, high: hysteresis thresholds on the Sobel gradient magnitude (OpenCV units).
            Pixels >= ``high`` seed edges; pixels >= ``low`` extend them.
        sigma: Gaussian smoothing applied first (scikit-image semantics, border
            renormalised); 0 when the image was already blurred (the APF pipeline).
        relative: read ``low`` and ``high`` as fractions of each image's largest gradient
            magnitude (in (0, 1]); invariant to rescaling an image, unlike fixed thresholds.
        norm: gradient magnitude ``sqrt(gi**2 + gj**2)`` ("l2", scikit-image) or
            ``|gi| + |gj|`` ("l1", OpenCV's default, which the APF authors' thresholds assume).

    Returns:
        Bool tensor of the input's shape; the one-pixel border is always False.

    Raises:
        ValueError: bad shape, ``low > high``, or relative thresholds outside (0, 1].
    """
    squeeze = grey.dim() == 2
    x = grey.unsqueeze(0) if squeeze else grey
    if x.dim() != 3:
        raise ValueError(
            f"grey must have shape (batch, height, width) or (height, width), got "
            f"{tuple(grey.shape)}; convert colour images with slipstream.vision.to_grey"
        )
    _check_thresholds(low, high, relative, norm)
    x = x if x.is_floating_point() else x.float()
    x = _smooth_renormalised(x, sigma)
    isobel, jsobel = _sobel(x)
    squared = norm == "l2"
    score = _magnitude(isobel, jsobel, squared)
    b = x.shape[0]
    peak = None
    if relative:
        peak = score.reshape(b, -1).amax(dim=1)
        peak = _sqrt_rn(peak) if squared else peak
    lo_t, hi_t = _thresholds(peak, low, high, b, score)
    # Dense pre-filter (on the squared magnitude for l2, loosened by a relative 1e-5 so
    # rounding never drops a pixel); the exact tests run at the few surviving pixels only.
    bound = lo_t * lo_t if squared else lo_t
    cand = score >= (bound * (1 - 1e-5)).view(b, 1, 1)
    cand[:, 0, :] = False
    cand[:, -1, :] = False
    cand[:, :, 0] = False
    cand[:, :, -1] = False
    peaks, mag = _non_maximum_suppression(isobel, jsobel, score, cand, lo_t, squared)
    strong = mag >= hi_t[peaks // (x.shape[1] * x.shape[2])]
    edges = _hysteresis(peaks, strong, x.shape)
    return edges[0] if squeeze else edges
