"""Leaves <-> tokens: crop-and-resize every quadtree leaf to P x P, and paint tokens back.

APF steps 4 and 8 (arXiv 2404.09707 sec. III-A): each leaf ``(y, x, s)`` becomes one P x P
token (larger leaves are downscaled, smaller ones upscaled), the mask goes through the same
tree, and per-token predictions are painted back into a full-resolution canvas.

Both directions are single gathers / strided writes, batched over images and leaves:

* Downscaling uses an average pyramid: a leaf of side ``s >= P`` read at pyramid level
  ``log2(s / P)`` is exactly its box-filtered (area) P x P version, so one gather per
  pyramid level extracts every token of that size class at once. Only the levels some leaf
  reads are built, the first in one f x f pooling pass (bool masks and uint8 images pooled in
  integers, never copied to float whole), or taken from the means the CPU edge pass pooled
  while it read the image (``means=``; leaves below that level are filtered one by one). ``mode="nearest"`` samples the pixel under each token
  pixel's centre instead.
* Upscaling (``s < P``) replicates pixels (nearest), so a mask round trip through leaves no
  larger than P is exact.
* :func:`tokens_to_image` writes each size class of leaves through a strided block view of
  the canvas: every output pixel is written once, O(R^2) time, no per-pixel index tensors.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from slipstream.vision.edges import numba_allowed
from slipstream.vision.quadtree import Leaves, _morton_perm

__all__ = ["extract_tokens", "patchify", "tokens_to_image"]

ResizeMode = Literal["area", "nearest"]
PoolBackend = Literal["auto", "torch", "numba"]


def _check_images(images: Tensor, leaves: Leaves, name: str) -> None:
    if images.dim() != 4 or images.shape[-1] != images.shape[-2]:
        raise ValueError(
            f"{name} must have shape (batch, channels, R, R), got {tuple(images.shape)}"
        )
    if images.shape[-1] != leaves.image_size or images.shape[0] != leaves.y.shape[0]:
        raise ValueError(
            f"{name} of shape {tuple(images.shape)} does not match the leaves (batch "
            f"{leaves.y.shape[0]}, image side {leaves.image_size}); build the tree from the "
            "same batch"
        )


def _pool_strips(
    images: Tensor, factor: int, rows: int = 256, backend: PoolBackend = "auto"
) -> Tensor:
    """(B, C, R/f, R/f) f x f box means of ``images`` (float, or bool / integer masks).

    One pass over the full-resolution input. CPU bool/uint8 inputs go through the numba
    integer kernel when ``backend`` allows it (see :func:`resolve_pool_backend`); other
    non-float inputs are converted to float one row strip at a time, while the strip is in
    cache (a whole-image ``float()`` is a 256 MB allocation and two more passes over memory
    at 8K).
    """
    if images.is_floating_point():
        return F.avg_pool2d(images, factor)  # one pass already; strips would add copies
    if factor > 1 and resolve_pool_backend(backend, images, factor) == "numba":
        return _pool_numba(images, factor)
    b, c, h, w = images.shape
    if images.dtype == torch.bool and factor > 1 and w % 8 == 0:
        return _pool_bool(images, factor)
    dtype = torch.float32
    out = torch.empty((b, c, h // factor, w // factor), dtype=dtype, device=images.device)
    step = max(factor, (rows // factor) * factor)
    for top in range(0, h, step):
        strip = images[:, :, top : top + step].to(dtype)
        out[:, :, top // factor : (top + step) // factor] = F.avg_pool2d(strip, factor)
    return out


_WORD = {2: (torch.int16, 0x0101, 8), 4: (torch.int32, 0x01010101, 24),
         8: (torch.int64, 0x0101010101010101, 56)}  # fmt: skip


def _pool_bool(mask: Tensor, factor: int) -> Tensor:
    """f x f means of a bool (B, C, H, W) tensor by byte counting, never converted to float.

    The bytes of ``w = min(f, 8)`` neighbouring pixels are read as one integer; multiplying
    by 0x01...01 adds them into its top byte (each sum <= 8, so no carries), one shift reads
    it. Exact: equal to ``avg_pool2d`` of the 0/1 floats (f*f is a power of two).
    """
    b, c, h, w = mask.shape
    word = min(factor, 8)
    dtype, ones, shift = _WORD[word]
    words = mask.contiguous().view(torch.uint8).view(dtype)  # (B, C, H, W / word)
    sums = (words * ones) >> shift
    if factor > word:
        sums = sums.view(b, c, h, w // factor, factor // word).sum(-1, dtype=torch.int32)
    sums = sums.view(b, c, h // factor, factor, w // factor).sum(3, dtype=torch.int32)
    return sums.float().div_(factor * factor)


_POOL_DTYPES = (torch.bool, torch.uint8)


def resolve_pool_backend(backend: str, images: Tensor, factor: int) -> str:
    """The kernel :func:`extract_tokens` pools ``images`` with: ``"torch"`` or ``"numba"``.

    numba covers f x f means of CPU bool/uint8 tensors (masks, 8-bit images) for f a power of
    two; everything else (floats, other devices) is torch's, whatever ``backend`` says, since
    ``avg_pool2d`` already reads floats once. ``"auto"`` uses numba when it is installed.

    Raises:
        ValueError: ``backend`` is not one of "auto", "torch", "numba".
        ImportError: "numba" was asked for and numba is not installed.
    """
    fits = (
        images.device.type == "cpu"
        and images.dtype in _POOL_DTYPES
        and factor & (factor - 1) == 0
        and images.shape[-1] % factor == 0
        and images.shape[-2] % factor == 0
    )
    return "numba" if numba_allowed(backend) and fits else "torch"


def _pool_numba(images: Tensor, factor: int) -> Tensor:
    """f x f means of a CPU bool/uint8 (B, C, H, W) tensor by the numba integer kernel."""
    from slipstream.vision._numba_kernels import box_means, pool_scratch

    b, c, h, w = images.shape
    planes = images.contiguous().view(torch.uint8).view(b * c, h, w).numpy()
    out = torch.empty((b, c, h // factor, w // factor), dtype=torch.float32)
    dst = out.view(b * c, h // factor, w // factor).numpy()
    n_out = h // factor
    threads = max(1, min(torch.get_num_threads(), n_out // 8))
    bounds = [n_out * k // threads for k in range(threads + 1)]

    def band(k: int) -> None:
        acc, fold = pool_scratch(1, w, factor, planes.dtype)
        box_means(planes, bounds[k], bounds[k + 1], acc, fold, dst)

    if threads == 1:
        band(0)
    else:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(band, range(threads)))
    return out


def _pyramid(
    images: Tensor, first: int, last: int, backend: PoolBackend = "auto"
) -> list[Tensor | None]:
    """Average pyramid levels ``first``..``last`` flattened to (B, C, H_k * W_k); None below.

    Level ``first`` is one f x f box mean of the input (f = 2**first), the rest 2 x 2 means
    of the level above; level 0 is the input itself (a view).
    """
    out: list[Tensor | None] = [None] * first
    level = images if first == 0 else _pool_strips(images, 1 << first, backend=backend)
    out.append(level.flatten(2))
    for _ in range(first, last):
        level = _pool_strips(level, 2, backend=backend)
        out.append(level.flatten(2))
    return out


def _levels_from_means(
    images: Tensor, means: tuple[int, Tensor], first: int, last: int
) -> tuple[list[Tensor | None], range]:
    """Pyramid levels 0..``last`` from precomputed f x f ``means``, and the levels between
    ``first`` and log2(f) that no level covers (their leaves are filtered one by one)."""
    factor, coarse = means
    b, c, r, _ = images.shape
    if (
        factor < 2
        or factor & (factor - 1)
        or coarse.shape != (b, c, r // factor, r // factor)
        or images.device.type != "cpu"
        or images.dtype not in (torch.float32, torch.uint8)
    ):
        raise ValueError(
            f"means=(factor={factor}, shape {tuple(coarse.shape)}) do not fit images of shape "
            f"{tuple(images.shape)} ({images.dtype} on {images.device}): they are the "
            "(B, C, R/f, R/f) means of CPU float32/uint8 images from edge_points_and_means"
        )
    k0 = factor.bit_length() - 1
    levels: list[Tensor | None] = [None] * (last + 1)
    if first == 0:
        levels[0] = images.flatten(2)
    if last >= k0:
        level = coarse
        levels[k0] = level.flatten(2)
        for k in range(k0 + 1, last + 1):
            level = F.avg_pool2d(level, 2)
            levels[k] = level.flatten(2)
    return levels, range(max(first, 1), min(k0, last + 1))


def _leaf_means(images: Tensor, bi: Tensor, ys: Tensor, xs: Tensor, side: int, p: int) -> Tensor:
    """(n, C, P, P) float32 box means of the ``side`` x ``side`` leaves at (bi, ys, xs)."""
    from slipstream.vision._numba_kernels import leaf_means, pool_scratch

    x = images.contiguous().numpy()
    out = torch.empty((bi.numel(), images.shape[1], p, p), dtype=torch.float32)
    acc, fold = pool_scratch(images.shape[1], side, side // p, x.dtype)
    leaf_means(x, bi.numpy(), ys.numpy(), xs.numpy(), side, acc, fold, out.numpy())
    return out


def extract_tokens(
    images: Tensor,
    leaves: Leaves,
    patch_size: int,
    mode: ResizeMode = "area",
    backend: PoolBackend = "auto",
    means: tuple[int, Tensor] | None = None,
) -> Tensor:
    """Resize every leaf of ``images`` (B, C, R, R) to ``patch_size`` x ``patch_size``.

    Returns:
        (B, L, C, P, P) tokens in leaf order; padding leaves give all-zero tokens.

    Accepts float or bool/integer images (masks); returns float32 for the latter (values
    unscaled: a uint8 image gives tokens in 0-255). ``backend`` picks the kernel that pools
    bool/uint8 CPU inputs (:func:`resolve_pool_backend`); the values are the same either way.

    ``means`` = (f, (B, C, R / f, R / f) f x f means of ``images``), as
    :func:`~slipstream.vision.edges.edge_points_and_means` gives them with the edges (CPU
    float32/uint8 images, area mode): the pyramid starts from them instead of a pass over
    ``images``, and leaves too small for them are box-filtered from their own pixels (a
    numba kernel). uint8 tokens are then exactly the same; float32 ones equal up to float
    rounding (sums in another order than ``avg_pool2d``).
    Memory: the pyramid levels the leaves use (at most 1/3 of ``images``) plus the tokens.
    """
    _check_images(images, leaves, "images")
    p = patch_size
    x = images
    b, c, r, _ = x.shape
    dtype = x.dtype if x.is_floating_point() else torch.float32
    size = leaves.size.clamp(min=1)
    i = torch.arange(p, device=x.device)
    if mode == "area":
        big = size >= p
        shift = torch.where(big, (size // p).float().log2().round().long(), torch.zeros_like(size))
        used = shift[leaves.valid]
        first, last = (int(used.min()), int(used.max())) if used.numel() else (0, 0)
        # Only the levels some leaf reads; non-float inputs (bool masks, uint8 images) are
        # pooled in integers (or per float strip), and level 0 is read as is: only the
        # gathered token pixels are converted to float.
        if means is not None:
            levels, direct = _levels_from_means(x, means, first, last)
        else:
            levels, direct = _pyramid(x, first, last, backend), range(0)
        # Level-k coordinates of the token's first row/col; small leaves replicate pixels.
        y0, x0 = (leaves.y.clamp(min=0) >> shift), (leaves.x.clamp(min=0) >> shift)
        step_i = torch.where(big.unsqueeze(-1), i, (i * size.unsqueeze(-1)) // p)
        rows, cols, n = y0.unsqueeze(-1) + step_i, x0.unsqueeze(-1) + step_i, r >> shift
    elif mode == "nearest":
        if means is not None:
            raise ValueError("means are for mode='area' tokens; pass means=None with 'nearest'")
        levels, direct = [x.flatten(2)], range(0)
        shift, n = torch.zeros_like(size), torch.full_like(size, r)
        centre = ((2 * i + 1) * size.unsqueeze(-1)) // (2 * p)
        rows = leaves.y.clamp(min=0).unsqueeze(-1) + centre
        cols = leaves.x.clamp(min=0).unsqueeze(-1) + centre
    else:
        raise ValueError(f"mode={mode!r} is not a resize mode; use 'area' or 'nearest'")
    index = rows.unsqueeze(-1) * n[..., None, None] + cols.unsqueeze(-2)  # (B, L, P, P)
    tokens = torch.zeros((b, leaves.length, c, p, p), dtype=dtype, device=x.device)
    for k, level in enumerate(levels):
        bi, li = (leaves.valid & (shift == k)).nonzero(as_tuple=True)
        if k in direct and bi.numel():  # box means of the leaves' own pixels
            tokens[bi, li] = _leaf_means(x, bi, leaves.y[bi, li], leaves.x[bi, li], p << k, p)
        elif level is not None and bi.numel():
            flat = index[bi, li].reshape(-1)  # one gather per pyramid level
            vals = level[bi.repeat_interleave(p * p), :, flat]  # (k * P * P, C)
            tokens[bi, li] = vals.view(-1, p, p, c).permute(0, 3, 1, 2).to(dtype)
    return tokens


def patchify(
    images: Tensor, patch_size: int, order: Literal["morton", "raster"] = "morton"
) -> Tensor:
    """Plain ViT patching: (B, C, R, R) -> (B, (R/P)**2, C, P, P) non-overlapping patches.

    ``order="morton"`` lists patches in the quadtree's Z order (what APF produces for a
    uniform tree); ``"raster"`` is the usual row-major ViT order.
    """
    b, c, h, w = images.shape
    p = patch_size
    if h % p or w % p:
        raise ValueError(
            f"images of shape {tuple(images.shape)} do not split into {p} x {p} patches; "
            "resize to a multiple of the patch size"
        )
    gh, gw = h // p, w // p
    out = images.reshape(b, c, gh, p, gw, p).permute(0, 2, 4, 1, 3, 5).reshape(b, gh * gw, c, p, p)
    if order == "raster":
        return out
    if order != "morton" or gh != gw or gh & (gh - 1):
        raise ValueError(
            f"order={order!r} with a {gh} x {gw} patch grid: Morton order needs a square "
            "power-of-two grid and order is 'morton' or 'raster'"
        )
    return out[:, _morton_perm(gh, images.device)]


def tokens_to_image(values: Tensor, leaves: Leaves, fill: float = 0.0) -> Tensor:
    """Paint per-token maps back at full resolution (nearest resize of each token to its leaf).

    Args:
        values: (B, L, P, P) or (B, L, C, P, P) per-token maps (logits, probabilities, labels).
        leaves: the tree the tokens came from.
        fill: value of pixels no valid leaf covers (only after leaves were dropped).

    Returns:
        (B, R, R) or (B, C, R, R), matching ``values``. Padding tokens are ignored.
    """
    squeeze = values.dim() == 4
    v = values.unsqueeze(2) if squeeze else values
    if v.dim() != 5 or v.shape[:2] != leaves.valid.shape or v.shape[-1] != v.shape[-2]:
        raise ValueError(
            f"values must have shape (batch, L, [channels,] P, P) with (batch, L) = "
            f"{tuple(leaves.valid.shape)}, got {tuple(values.shape)}"
        )
    b, _, c, p, _ = v.shape
    r = leaves.image_size
    canvas = torch.full((b, c, r, r), fill, dtype=v.dtype, device=v.device)
    valid_sizes = leaves.size[leaves.valid]
    for s in valid_sizes.unique().tolist():
        sel = leaves.valid & (leaves.size == s)
        bi, li = sel.nonzero(as_tuple=True)
        patch = v[bi, li]  # (k, C, P, P)
        if s >= p:
            f = s // p
            k = patch.shape[0]
            patch = patch[:, :, :, None, :, None].expand(k, c, p, f, p, f).reshape(k, c, s, s)
        else:
            pick = ((2 * torch.arange(s, device=v.device) + 1) * p) // (2 * s)
            patch = patch[:, :, pick][:, :, :, pick]
        n = r // s
        blocks = canvas.view(b, c, n, s, n, s).permute(0, 2, 4, 1, 3, 5)
        blocks[bi, leaves.y[bi, li] // s, leaves.x[bi, li] // s] = patch
    return canvas[:, 0] if squeeze else canvas
