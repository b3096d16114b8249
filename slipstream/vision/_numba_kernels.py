"""The CPU kernels of APF preprocessing (numba: compiled on first use, cached on disk).

One module, so numba's on-disk cache, which is keyed to the file a kernel is defined in,
never keeps a kernel compiled against an older version of a helper it calls.

**Edges** (:func:`band_edges`, :func:`band_peak`, :func:`hysteresis`), behind
:func:`slipstream.vision.edges.edge_points` with ``backend="numba"``. The eager torch
pipeline (grey -> blur -> Sobel -> non-maximum suppression) makes about twenty passes over
every row strip; this makes one: each grey row is computed, blurred, differentiated and
thinned while it is in cache, in a ring of a few rows, and only the surviving edge candidates
leave the kernel; union-find :func:`hysteresis` then joins them. The edge output is
*identical* to the torch backend, not merely close: every rounding is the same. Where torch
computes ``a + alpha * b`` (``add_`` with ``alpha``, ``addcmul_``) its CPU kernels (and
CUDA's) use a fused multiply-add, so the kernels here call ``llvm.fma`` at exactly those
places; everything else is a plain IEEE operation in the image's dtype (numba does not
contract ``a * b + c`` without fast-math). Tests compare the two backends bit for bit.

**Box means** for tokens, all through one row kernel, :func:`pool_row` (column sums of f rows
in an integer or float32 row, then pairwise folds of neighbours): inside the edge pass, which
adds every image row into f x f means as it reads it (``band_edges(coarse=...)``), so the
tokens need no second pass over the image; over whole bool/uint8 planes (:func:`box_means`,
behind ``tokens._pool_strips``), exact, never converting to float; and over single leaves
(:func:`leaf_means`, for leaves below the level the edge pass pooled).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

__all__ = [
    "band_edges",
    "band_peak",
    "box_means",
    "hysteresis",
    "leaf_means",
    "pool_row",
    "pool_scratch",
]


@intrinsic
def _fma(typingctx, a, b, c):  # type: ignore[no-untyped-def]
    """a * b + c with one rounding (llvm.fma) for float32 or float64 ``b`` and ``c``; an
    integer ``a`` (a uint8 pixel) is converted to their type first (exactly)."""
    if not (isinstance(b, types.Float) and b == c and (a == b or isinstance(a, types.Integer))):
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        ty = context.get_value_type(signature.return_type)
        x = context.cast(builder, args[0], signature.args[0], signature.return_type)
        fn = builder.module.declare_intrinsic("llvm.fma", [ty], ir.FunctionType(ty, [ty, ty, ty]))
        return builder.call(fn, [x, args[1], args[2]])

    return b(a, b, c), codegen


@njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _reflect(j: int, n: int) -> int:
    """Row ``j`` of a plane of ``n`` rows, mirrored at the borders (``F.pad`` "reflect")."""
    if j < 0:
        j = -j
    if j >= n:
        j = 2 * (n - 1) - j
    return j


@njit(cache=True, nogil=True, error_model="numpy")
def _grey_hblur(img, j, luma, taps, g, out):  # type: ignore[no-untyped-def]
    """Rounded 0-255 grey of image row ``j``, blurred along the row, into ``out``.

    ``img`` is float (``luma``'s dtype, the compute dtype) or uint8, whose pixels convert to
    the compute dtype exactly.
    """
    c, _, w = img.shape
    r = (taps.shape[0] - 1) // 2
    if c == 1:
        a = luma[0]
        x0 = img[0, j]
        for x in range(w):
            g[r + x] = np.rint(x0[x] * a)
    else:
        a, b, cc = luma[0], luma[1], luma[2]
        x0, x1, x2 = img[0, j], img[1, j], img[2, j]
        for x in range(w):
            g[r + x] = np.rint(_fma(x2[x], cc, _fma(x1[x], b, x0[x] * a)))
    for k in range(r):  # reflect the columns
        g[k] = g[2 * r - k]
        g[r + w + k] = g[r + w - 2 - k]
    if r == 0:
        for x in range(w):
            out[x] = g[x]
        return
    t0 = taps[0]
    if r == 1:  # the default 3-tap blur in one pass; the same roundings as the loop below
        t1, t2 = taps[1], taps[2]
        for x in range(w):
            out[x] = _fma(g[x + 2], t2, _fma(g[x + 1], t1, g[x] * t0))
        return
    for x in range(w):
        out[x] = g[x] * t0
    for k in range(1, 2 * r + 1):
        t = taps[k]
        for x in range(w):
            out[x] = _fma(g[x + k], t, out[x])


@njit(cache=True, nogil=True, error_model="numpy")
def _sobel_row(
    img, luma, taps, s, state, hring, bring, gi, gj, score, squared, cacc, cfold, coarse
):  # type: ignore[no-untyped-def]
    """Compute Sobel row ``s`` into ring slot ``s % 3`` of ``gi``, ``gj`` and ``score``.

    ``state`` = [highest horizontally blurred row computed, highest blurred row computed,
    first and end row to pool]; ``hring`` (slot ``row % len``) and ``bring`` (slot
    ``row % 4``, column-padded) are the grey and blurred rings. Blurred rows outside the image
    repeat the border row (``F.pad`` "replicate"), as in the torch pipeline. Image rows in
    the pooling range are also added into ``coarse`` (see :func:`pool_row`) as they are read.
    """
    _, h, w = img.shape
    r = (taps.shape[0] - 1) // 2
    nh = hring.shape[0]
    need = min(s + 1, h - 1)
    while state[1] < need:
        k = state[1] + 1
        while state[0] < min(k + r, h - 1):
            state[0] += 1
            _grey_hblur(img, state[0], luma, taps, hring[nh - 1], hring[state[0] % (nh - 1)])
            if state[2] <= state[0] < state[3]:  # the band's own rows, each read once
                pool_row(img, state[0], cacc, cfold, coarse)
        o = bring[k % 4]
        if r == 0:
            src = hring[k % (nh - 1)]
            for x in range(w):
                o[x + 1] = src[x]
        elif r == 1:  # one pass, the same roundings as the general loop
            a0 = hring[_reflect(k - 1, h) % (nh - 1)]
            a1 = hring[_reflect(k, h) % (nh - 1)]
            a2 = hring[_reflect(k + 1, h) % (nh - 1)]
            t0, t1, t2 = taps[0], taps[1], taps[2]
            for x in range(w):
                o[x + 1] = _fma(a2[x], t2, _fma(a1[x], t1, a0[x] * t0))
        else:
            src = hring[_reflect(k - r, h) % (nh - 1)]
            t0 = taps[0]
            for x in range(w):
                o[x + 1] = src[x] * t0
            for m in range(1, 2 * r + 1):
                src = hring[_reflect(k - r + m, h) % (nh - 1)]
                t = taps[m]
                for x in range(w):
                    o[x + 1] = _fma(src[x], t, o[x + 1])
        o[0] = o[1]
        o[w + 1] = o[w]
        state[1] = k
    u = bring[max(s - 1, 0) % 4]
    m_ = bring[s % 4]
    d = bring[min(s + 1, h - 1) % 4]
    gi_o, gj_o, sc = gi[s % 3], gj[s % 3], score[s % 3]
    for x in range(w):
        dm = m_[x + 2] - m_[x]
        vj = ((u[x + 2] - u[x]) + (d[x + 2] - d[x])) + (dm + dm)
        im = d[x + 1] - u[x + 1]
        vi = ((d[x] - u[x]) + (d[x + 2] - u[x + 2])) + (im + im)
        gi_o[x] = vi
        gj_o[x] = vj
        if squared:
            sc[x] = _fma(vj, vj, vi * vi)
        else:
            sc[x] = abs(vi) + abs(vj)


def _rings(w: int, r: int, dtype: np.dtype) -> tuple[np.ndarray, ...]:
    """Per-band scratch: ring state, grey ring (2r + 1 rows + one padded scratch row),
    blurred ring (4 column-padded rows), and the three-row Sobel rings gi, gj, score."""
    hring = np.empty((2 * r + 2, w + 2 * r), dtype)
    bring = np.empty((4, w + 2), dtype)
    state = np.zeros(4, np.int64)  # [grey row, blurred row, pooled rows lo, hi]: no pooling
    return (state, hring, bring, *(np.empty((3, w), dtype) for _ in range(3)))


@njit(cache=True, nogil=True, error_model="numpy")
def _start(state, taps, first_sobel):  # type: ignore[no-untyped-def]
    """Point the rings at a band whose first Sobel row is ``first_sobel``."""
    r = (taps.shape[0] - 1) // 2
    kb = max(first_sobel - 1, 0)  # first blurred row it reads
    state[1] = kb - 1
    state[0] = max(kb - r, 0) - 1  # reflected rows above kb are all <= kb + r


@njit(cache=True, nogil=True, error_model="numpy")
def _band_peak(img, luma, taps, top, bottom, squared, state, hring, bring, gi, gj, score,
               cacc, cfold, coarse):  # type: ignore[no-untyped-def]  # fmt: skip
    """Largest gradient score (squared magnitude for l2) over rows [top, bottom)."""
    _start(state, taps, top)
    best = score[0, 0]  # typed placeholder, replaced by the first value
    first = True
    for s in range(top, bottom):
        _sobel_row(
            img, luma, taps, s, state, hring, bring, gi, gj, score, squared, cacc, cfold, coarse
        )
        row = score[s % 3]
        for x in range(row.shape[0]):
            if first or row[x] > best:
                best = row[x]
                first = False
    return best


@njit(cache=True, nogil=True, error_model="numpy")
def _band_edges(img, luma, taps, top, bottom, th, squared,
                state, hring, bring, gi, gj, score, cacc, cfold, coarse, out_idx, out_strong):  # type: ignore[no-untyped-def]  # fmt: skip
    """Non-maximum-suppressed edge candidates of rows [top, bottom) (never the border).

    ``th`` = [prefilter bound on the score, low, high, 1] in the image dtype. Writes flat
    in-image indices (row-major) and their strong flags; returns how many. Rows
    ``state[2]:state[3]`` are pooled into ``coarse`` on the way.
    """
    _, h, w = img.shape
    q0, q1 = max(top, 1), min(bottom, h - 1)
    n = 0
    if q1 <= q0:
        for j in range(state[2], state[3]):  # no Sobel row here, but the pixels still pool
            pool_row(img, j, cacc, cfold, coarse)
        return n
    bound, low, high, one = th[0], th[1], th[2], th[3]
    _start(state, taps, q0 - 1)
    for s in range(q0 - 1, q1 + 1):
        _sobel_row(
            img, luma, taps, s, state, hring, bring, gi, gj, score, squared, cacc, cfold, coarse
        )
        q = s - 1
        if q < q0:
            continue
        mq, mu, md = score[q % 3], score[(q - 1) % 3], score[(q + 1) % 3]
        giq, gjq = gi[q % 3], gj[q % 3]
        for x0 in range(1, w - 1, 64):  # runs of 64 pixels: a vectorised count skips empty ones
            x1 = min(x0 + 64, w - 1)
            hits = 0
            for x in range(x0, x1):
                hits += mq[x] >= bound
            if hits == 0:
                continue
            for x in range(x0, x1):
                sq = mq[x]
                if sq < bound:
                    continue
                m = np.sqrt(sq) if squared else sq
                if m < low:
                    continue
                vi, vj = giq[x], gjq[x]
                same = (vi > 0) == (vj > 0)
                ai, aj = abs(vi), abs(vj)
                row_axial = ai > aj if same else ai >= aj
                wgt = min(ai, aj) / max(ai, aj)
                rest = one - wgt
                # Diagonal neighbour: down-right / up-left when the signs agree, else up-right /
                # down-left. Axial: along rows (down / up, or up / down) or along columns.
                if same:
                    dp, dn = md[x + 1], mu[x - 1]
                else:
                    dp, dn = mu[x + 1], md[x - 1]
                if not row_axial:
                    ap, an = mq[x + 1], mq[x - 1]
                elif same:
                    ap, an = md[x], mu[x]
                else:
                    ap, an = mu[x], md[x]
                if squared:
                    dp, dn, ap, an = np.sqrt(dp), np.sqrt(dn), np.sqrt(ap), np.sqrt(an)
                if dp * wgt + ap * rest <= m and dn * wgt + an * rest <= m:
                    out_idx[n] = q * w + x
                    out_strong[n] = m >= high
                    n += 1
    return n


def band_peak(
    img: np.ndarray, luma: np.ndarray, taps: np.ndarray, top: int, bottom: int, squared: bool
) -> float:
    """Largest score over rows [top, bottom) of one (C, H, W) image."""
    r = (taps.shape[0] - 1) // 2
    rings = _rings(img.shape[2], r, luma.dtype)
    return float(_band_peak(img, luma, taps, top, bottom, squared, *rings, *_no_pool()))


def _no_pool() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Placeholder ``cacc``, ``cfold``, ``coarse`` of a call that pools nothing."""
    return (
        np.empty((0, 0), np.float32),
        np.empty((2, 0), np.float32),
        np.empty((0, 1, 0), np.float32),
    )


def pool_scratch(c: int, w: int, factor: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """``acc`` and ``fold`` for :func:`pool_row` on ``c`` channels of width ``w`` of ``dtype``
    pixels: int16 column sums of uint8 for f <= 128 (int32 above: f * 255 must fit), float32
    for floats; float64 folds where f * f * 255 would pass 2**24, so integer sums stay exact."""
    if dtype == np.uint8:
        acc = np.empty((c, w), np.int16 if factor <= 128 else np.int32)
    else:
        acc = np.empty((c, w), np.float32)
    wide = dtype == np.uint8 and factor * factor * 255 >= 1 << 24
    return acc, np.empty((2, max(w // 2, 1)), np.float64 if wide else np.float32)


def band_edges(
    img: np.ndarray,
    luma: np.ndarray,
    taps: np.ndarray,
    top: int,
    bottom: int,
    th: np.ndarray,
    squared: bool,
    coarse: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Edge candidates of rows [top, bottom) of one (C, H, W) image: (flat index, strong).

    ``coarse``: a (C, H / f, W / f) float32 array whose rows ``top / f : bottom / f`` receive
    the f x f means of the image as its rows stream through the kernel (``top`` and ``bottom``
    multiples of f), so the tokens need no second pass over the image.
    """
    c, h, w = img.shape
    r = (taps.shape[0] - 1) // 2
    cap = max(min(bottom, h - 1) - max(top, 1), 0) * max(w - 2, 0)
    idx = np.empty(cap, np.int64)
    strong = np.empty(cap, np.bool_)
    rings = _rings(w, r, luma.dtype)
    if coarse is None:
        pool = _no_pool()
    else:
        rings[0][2:] = (top, bottom)
        pool = (*pool_scratch(c, w, h // coarse.shape[1], img.dtype), coarse)
    n = _band_edges(img, luma, taps, top, bottom, th, squared, *rings, *pool, idx, strong)
    return idx[:n], strong[:n]


@njit(cache=True, nogil=True, inline="always")
def _find(parent, i):  # type: ignore[no-untyped-def]
    """Root of ``i``, halving the path on the way."""
    while parent[i] != i:
        parent[i] = parent[parent[i]]
        i = parent[i]
    return i


@njit(cache=True, nogil=True)
def hysteresis(idx, strong, width):  # type: ignore[no-untyped-def]
    """The entries of ``idx`` whose 8-connected component holds a ``strong`` one.

    The sequential twin of ``edges._hysteresis_sparse`` (same input contract: sorted flat
    indices, none on the border, rows of ``width``): the neighbours right, down-left, down
    and down-right of each pixel are found by one merge of ``idx`` with ``idx + offset``
    (both sorted), joined by union-find. O(n) after the sort the kernels already gave.
    """
    n = idx.shape[0]
    parent = np.arange(n)
    for off in (1, width - 1, width, width + 1):
        j = 0
        for i in range(n):
            t = idx[i] + off
            while j < n and idx[j] < t:
                j += 1
            if j == n:
                break
            if idx[j] == t:
                a, b = _find(parent, i), _find(parent, j)
                if a != b:
                    parent[max(a, b)] = min(a, b)
    lit = np.zeros(n, np.bool_)
    for i in range(n):
        if strong[i]:
            lit[_find(parent, i)] = True
    keep = np.empty(n, np.bool_)
    for i in range(n):
        keep[i] = lit[_find(parent, i)]
    return idx[keep]


@njit(cache=True, nogil=True, error_model="numpy")
def pool_row(img, j, acc, fold, coarse):  # type: ignore[no-untyped-def]
    """Add image row ``j`` (all channels) into the f x f means ``coarse`` (C, H / f, W / f).

    ``acc`` (C, >= W) holds the column sums of the current f rows (int16 for uint8 pixels and
    f <= 128: exact, and twice the lanes of float32; float32 otherwise): row ``j % f == 0``
    starts them, row ``j % f == f - 1`` folds neighbouring pairs log2(f) times through
    ``fold`` (2, >= W / 2; float32, or float64 where f * f * 255 reaches 2**24) into one
    output row. Rows must come in order within each group of f. Integer pixels (uint8) sum
    exactly; float sums round like any float32 sum.
    """
    c, h, w = img.shape
    f = h // coarse.shape[1]
    wo = coarse.shape[2]
    dy = j % f
    inv = np.float32(1.0) / np.float32(f * f)  # exact: f is a power of two
    for ch in range(c):
        row = img[ch, j]
        a = acc[ch]
        if dy == 0:
            for x in range(w):
                a[x] = row[x]
        else:
            for x in range(w):
                a[x] += row[x]
        if dy == f - 1:  # pairwise folds vectorise; integer sums stay exact in ``fold``
            n = w // 2
            for x in range(n):
                fold[0, x] = a[2 * x] + a[2 * x + 1]
            src = 0
            while n > wo:
                n //= 2
                u, v = fold[src], fold[1 - src]
                for x in range(n):
                    v[x] = u[2 * x] + u[2 * x + 1]
                src = 1 - src
            dst, u = coarse[ch, j // f], fold[src]
            for ox in range(wo):
                dst[ox] = u[ox] * inv


@njit(cache=True, nogil=True, error_model="numpy")
def box_means(planes, row0, row1, acc, fold, out):  # type: ignore[no-untyped-def]
    """Output rows ``row0:row1`` of the f x f means of ``planes`` (P, H, W) uint8 into
    ``out`` (P, H / f, W / f) float32, plane by plane through :func:`pool_row`."""
    f = planes.shape[1] // out.shape[1]
    for p in range(planes.shape[0]):
        for j in range(row0 * f, row1 * f):
            pool_row(planes[p : p + 1], j, acc, fold, out[p : p + 1])


@njit(cache=True, nogil=True, error_model="numpy")
def leaf_means(images, bi, ys, xs, side, acc, fold, out):  # type: ignore[no-untyped-def]
    """P x P box means of the ``side`` x ``side`` leaves at (``bi``, ``ys``, ``xs``) of
    ``images`` (B, C, H, W) into ``out`` (n, C, P, P) float32: each leaf's own pixels only,
    through :func:`pool_row`."""
    for i in range(bi.shape[0]):
        y, x = ys[i], xs[i]
        leaf = images[bi[i], :, y : y + side, x : x + side]
        for j in range(side):
            pool_row(leaf, j, acc, fold, out[i])
