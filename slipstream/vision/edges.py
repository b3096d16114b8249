"""Grey conversion, Gaussian smoothing and a batched Canny edge detector in PyTorch.

Steps 1-2 of the Adaptive Patch Framework (APF, Zhang et al., SC24, arXiv 2404.09707,
sec. III-A: "Gaussian blur then Canny"). Everything is dense tensor arithmetic plus one sparse
connected-components pass, so it runs on CPU or GPU for any batch of images.

The detector follows Canny (1986) the way scikit-image's ``feature.canny`` does (tests compare
the two pixel by pixel): Gaussian smoothing with border renormalisation, 3x3 Sobel gradients,
non-maximum suppression with linear interpolation between the two neighbours along the
gradient, and hysteresis with 8-connectivity. The one-pixel image border is never an edge.

Threshold units: intensities are on the 0-255 scale, so the APF defaults ``(100, 200)`` mean
what they mean for OpenCV's ``Canny`` on 8-bit images.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["canny", "gaussian_blur", "gaussian_kernel_sigma", "to_grey"]

# ITU-R BT.601 luma weights (what OpenCV and scikit-image use for RGB -> grey).
_LUMA = (0.299, 0.587, 0.114)


def to_grey(images: Tensor) -> Tensor:
    """Convert ``images`` of shape (B, C, H, W), values in [0, 1], to (B, H, W) on 0-255.

    C = 1 is taken as is; C = 3 uses BT.601 luma weights; C = 4 drops alpha.

    Raises:
        ValueError: ``images`` is not 4-D or has a channel count other than 1, 3 or 4.
    """
    if images.dim() != 4 or images.shape[1] not in (1, 3, 4):
        raise ValueError(
            f"images must have shape (batch, channels, height, width) with 1, 3 or 4 channels, "
            f"got {tuple(images.shape)}; add a batch axis with images.unsqueeze(0)"
        )
    x = images.float() if not images.is_floating_point() else images
    if x.shape[1] == 1:
        return x[:, 0] * 255.0
    w = torch.tensor(_LUMA, dtype=x.dtype, device=x.device)
    return torch.einsum("bchw,c->bhw", x[:, :3], w) * 255.0


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
    """Correlate each (H, W) plane of ``x`` (B, H, W) with ``taps`` along rows then columns."""
    r = (taps.numel() - 1) // 2
    x = x.unsqueeze(1)
    x = F.pad(x, (r, r, r, r), mode=mode) if mode != "constant" else F.pad(x, (r, r, r, r))
    x = F.conv2d(x, taps.view(1, 1, -1, 1))
    x = F.conv2d(x, taps.view(1, 1, 1, -1))
    return x[:, 0]


def gaussian_blur(
    grey: Tensor, *, sigma: float | None = None, kernel_size: int | None = None
) -> Tensor:
    """Blur (B, H, W) planes with a Gaussian, borders reflected (OpenCV ``GaussianBlur`` style).

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
    return _separable(grey, taps, "reflect" if min(grey.shape[-2:]) > radius else "replicate")


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
    p = F.pad(x.unsqueeze(1), (1, 1, 1, 1), mode="replicate")[:, 0]
    dj = p[:, :, 2:] - p[:, :, :-2]  # [-1, 0, 1] along columns
    di = p[:, 2:, :] - p[:, :-2, :]  # [-1, 0, 1] along rows
    jsobel = dj[:, :-2] + 2 * dj[:, 1:-1] + dj[:, 2:]
    isobel = di[:, :, :-2] + 2 * di[:, :, 1:-1] + di[:, :, 2:]
    return isobel, jsobel


def _non_maximum_suppression(isobel: Tensor, jsobel: Tensor, mag: Tensor) -> Tensor:
    """True where ``mag`` is a local maximum along the gradient (interpolated neighbours).

    The gradient direction selects one axial neighbour (row or column step) and one diagonal
    neighbour on each side; the magnitude there is interpolated linearly with weight
    ``w = min(|gi|, |gj|) / max(|gi|, |gj|)``. A pixel survives when it is >= both
    interpolated values. Border pixels are never maxima.
    """
    p = F.pad(mag, (1, 1, 1, 1))
    h, w_ = mag.shape[-2:]

    def nb(di: int, dj: int) -> Tensor:
        return p[:, 1 + di : 1 + di + h, 1 + dj : 1 + dj + w_]

    same_sign = (isobel > 0) == (jsobel > 0)
    ai, aj = isobel.abs(), jsobel.abs()
    # Tie-breaking (|gi| == |gj|) follows scikit-image: axial step is a column step when the
    # signs agree and a row step when they differ.
    row_axial = torch.where(same_sign, ai > aj, ai >= aj)
    w = torch.minimum(ai, aj) / torch.maximum(ai, aj)
    axial_plus = torch.where(row_axial, torch.where(same_sign, nb(1, 0), nb(-1, 0)), nb(0, 1))
    axial_minus = torch.where(row_axial, torch.where(same_sign, nb(-1, 0), nb(1, 0)), nb(0, -1))
    diag_plus = torch.where(same_sign, nb(1, 1), nb(-1, 1))
    diag_minus = torch.where(same_sign, nb(-1, -1), nb(1, -1))
    keep = (diag_plus * w + axial_plus * (1.0 - w) <= mag) & (
        diag_minus * w + axial_minus * (1.0 - w) <= mag
    )
    keep[:, 0, :] = False
    keep[:, -1, :] = False
    keep[:, :, 0] = False
    keep[:, :, -1] = False
    return keep


def _hysteresis(weak: Tensor, strong: Tensor) -> Tensor:
    """Keep the 8-connected components of ``weak`` that contain a ``strong`` pixel.

    Connected components of the sparse set of candidate pixels by root hooking plus pointer
    jumping (Shiloach-Vishkin style): O(log n) rounds of gathers and one ``scatter_reduce``
    each, instead of a flood fill whose round count grows with the longest edge curve.
    Requires the one-pixel border of ``weak`` to be False (neighbour indices stay in-plane).
    """
    b, h, w = weak.shape
    flat = weak.reshape(-1)
    idx = flat.nonzero().squeeze(1)
    n = idx.numel()
    if n == 0:
        return weak.clone()
    id_dtype = torch.int32 if flat.numel() < 2**31 else torch.int64
    ids = torch.full((flat.numel(),), -1, dtype=id_dtype, device=weak.device)
    ids[idx] = torch.arange(n, dtype=id_dtype, device=weak.device)
    src, dst = [], []
    for off in (1, w - 1, w, w + 1):  # right, down-left, down, down-right neighbours
        nbr = ids[idx + off].long()
        hit = nbr >= 0
        src.append(hit.nonzero().squeeze(1))
        dst.append(nbr[hit])
    u, v = torch.cat(src), torch.cat(dst)
    parent = torch.arange(n, device=weak.device)
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
    has_strong = torch.zeros(n, dtype=torch.bool, device=weak.device)
    has_strong.scatter_reduce_(0, parent, strong.reshape(-1)[idx], reduce="amax")
    out = torch.zeros_like(flat)
    out[idx] = has_strong[parent]
    return out.view(b, h, w)


def canny(
    grey: Tensor,
    low: float = 100.0,
    high: float = 200.0,
    *,
    sigma: float = 0.0,
    relative: bool = False,
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
    if low > high:
        raise ValueError(f"canny low={low} must be <= high={high}; swap the two thresholds")
    if relative and not (0.0 < low <= 1.0 and 0.0 < high <= 1.0):
        raise ValueError(
            f"relative canny thresholds must lie in (0, 1], got low={low}, high={high}; "
            "pass relative=False for absolute 0-255 gradient thresholds"
        )
    x = x if x.is_floating_point() else x.float()
    x = _smooth_renormalised(x, sigma)
    isobel, jsobel = _sobel(x)
    mag = torch.sqrt(isobel * isobel + jsobel * jsobel)
    if relative:
        peak = mag.amax(dim=(1, 2), keepdim=True)
        lo_t, hi_t = low * peak, high * peak
    else:
        lo_t = torch.tensor(low, dtype=mag.dtype, device=mag.device)
        hi_t = torch.tensor(high, dtype=mag.dtype, device=mag.device)
    # A zero magnitude is never an edge, even with low == 0.
    lo_t = torch.clamp(lo_t, min=math.ulp(0.0) if mag.dtype == torch.float64 else 1e-30)
    weak = _non_maximum_suppression(isobel, jsobel, mag) & (mag >= lo_t)
    edges = _hysteresis(weak, weak & (mag >= hi_t))
    return edges[0] if squeeze else edges
