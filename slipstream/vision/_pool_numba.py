"""Box means for tokens on the CPU: whole 8-bit planes, or single leaves, in one pass each.

``box_means`` is the numba kernel behind :func:`slipstream.vision.tokens._pool_strips` for CPU
bool/uint8 inputs (compiled on first use and cached on disk); ``leaf_means`` filters the
leaves below the level the edge pass pooled (``extract_tokens(..., means=...)``). Two streaming stages per output row: the
``f`` input rows are added element-wise into one integer row (a vectorised add of contiguous
bytes), then every ``f`` neighbours of that row are summed. Each input byte is read once and no
float copy of the image is made; torch's route converts each strip to float first (four times
the bytes) and pools that.

Exact: integer sums of at most ``f * f * 255`` divided once by ``f * f``, the same as
``avg_pool2d`` of the values as floats (whose partial sums are small integers, also exact).
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["box_means", "leaf_means"]


@njit(cache=True, nogil=True)
def box_means(planes, f, row0, row1, acc, out):  # type: ignore[no-untyped-def]
    """Output rows ``row0:row1`` of the f x f means of ``planes`` (P, H, W) uint8 into ``out``.

    ``acc`` is a (W,) int16 or int32 scratch row, wide enough for ``f * 255`` (int16 holds it
    for f <= 128); ``out`` is (P, H / f, W / f) float32.
    """
    n, _, w = planes.shape
    wo = w // f
    scale = np.float32(1.0) / np.float32(f * f)  # exact: f * f is a power of two
    for p in range(n):
        for oy in range(row0, row1):
            top = oy * f
            first = planes[p, top]
            for x in range(w):
                acc[x] = first[x]
            for dy in range(1, f):
                row = planes[p, top + dy]
                for x in range(w):
                    acc[x] += row[x]
            dst = out[p, oy]
            for ox in range(wo):
                s = np.int32(0)
                base = ox * f
                for dx in range(f):
                    s += acc[base + dx]
                dst[ox] = np.float32(s) * scale


@njit(cache=True, nogil=True)
def leaf_means(images, bi, ys, xs, side, p, out):  # type: ignore[no-untyped-def]
    """P x P box means of the ``side`` x ``side`` leaves at (``bi``, ``ys``, ``xs``) into ``out``.

    ``images`` (B, C, H, W) uint8 or float32, ``out`` (n, C, P, P) float32. Reads only the
    leaves' own pixels (the small leaves of a tree, whose pyramid level was not built):
    column sums of f = side / P rows, then sums of f columns, like ``box_means``.
    """
    c = images.shape[1]
    f = side // p
    inv = np.float32(1.0) / np.float32(f * f)  # exact: f is a power of two
    acc = np.empty(side, np.float32)
    for i in range(bi.shape[0]):
        b, y, x0 = bi[i], ys[i], xs[i]
        for ch in range(c):
            plane = images[b, ch]
            for ty in range(p):
                top = y + ty * f
                row = plane[top]
                for x in range(side):
                    acc[x] = row[x0 + x]
                for dy in range(1, f):
                    row = plane[top + dy]
                    for x in range(side):
                        acc[x] += row[x0 + x]
                dst = out[i, ch, ty]
                for tx in range(p):
                    base = tx * f
                    v = acc[base]
                    for dx in range(1, f):
                        v += acc[base + dx]
                    dst[tx] = v * inv
