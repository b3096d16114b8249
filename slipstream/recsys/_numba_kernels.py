"""numba kernels of the HEAT trainer (HEAT, ICS '23, §4): per-sample, lock-free SGD.

Compiled on first call and cached on disk (``cache=True``); nothing is built at install
time. Every thread owns a contiguous chunk of the shuffled samples and, per sample:

1. draws negatives (uniform, or from its random tile, §4.2);
2. builds ``h_u`` and computes the dot products ``h·h``, ``h·e_k``, ``e_k·e_k`` row by row
   (no gathered, concatenated or normalised copies, §4.3);
3. forms the gradients from those cached dot products (§4.3, eqs. 4-5 with the sign of
   the true derivative, see ``run_chunk``), skipping negatives under the margin;
4. adds ``scale * gradient`` to the touched rows of ``outU`` / ``outV`` immediately
   (Hogwild), and to a thread-local W accumulator flushed every ``w_sync`` samples (§4.4).

With ``outU is U`` (etc.) and ``scale = -lr`` this is SGD in place; with zeroed outputs
and ``scale = 1/B`` it returns the exact mean gradient (tests compare it with autograd).
"""

from __future__ import annotations

import numpy as np
from numba import njit

EPS = 1e-8  # matches slipstream.recsys.model.COSINE_EPS

_MUL = np.uint64(0x2545F4914F6CDD1D)


@njit(cache=True)
def _next(state: np.ndarray) -> np.uint64:
    """xorshift64* step on a one-element uint64 state."""
    x = state[0]
    x ^= x >> np.uint64(12)
    x ^= x << np.uint64(25)
    x ^= x >> np.uint64(27)
    state[0] = x
    return x * _MUL


@njit(cache=True)
def _below(state: np.ndarray, n: int) -> int:
    """Uniform integer in [0, n) for n < 2**32 by multiply-shift (no division; the bias
    is below n / 2**32)."""
    return np.int64(((_next(state) >> np.uint64(32)) * np.uint64(n)) >> np.uint64(32))


@njit(cache=True)
def _refill_tile(state: np.ndarray, tile: np.ndarray, num_items: int) -> None:
    for q in range(tile.shape[0]):
        tile[q] = _below(state, num_items)


@njit(cache=True)
def _draw(state: np.ndarray, tile: np.ndarray, use_tile: bool, num_items: int) -> int:
    """One negative: uniform over the tile when tiling, else over all items."""
    if use_tile:
        return tile[_below(state, tile.shape[0])]
    return _below(state, num_items)


@njit(cache=True)
def sample_negatives(
    num_samples: int, num_neg: int, num_items: int, tile_size: int, refresh: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """The sampler of one kernel thread, standalone (for tests).

    Returns ``(negs [num_samples, num_neg], tiles [ceil(num_samples/refresh), tile_size])``;
    sample ``s`` drew from ``tiles[s // refresh]`` (``tiles`` is empty without tiling).
    """
    state = np.empty(1, np.uint64)
    state[0] = np.uint64(seed)
    use_tile = 0 < tile_size < num_items
    tile = np.empty(max(tile_size, 1), np.int64)
    n_tiles = (num_samples + refresh - 1) // refresh if use_tile else 0
    tiles = np.empty((n_tiles, tile_size if use_tile else 0), np.int64)
    negs = np.empty((num_samples, num_neg), np.int64)
    for s in range(num_samples):
        if use_tile and s % refresh == 0:
            _refill_tile(state, tile, num_items)
            tiles[s // refresh] = tile
        for j in range(num_neg):
            negs[s, j] = _draw(state, tile, use_tile, num_items)
    return negs, tiles


# indices into the float parameter vector ``fp`` (same dtype as the tables, so that all
# inner-loop arithmetic stays in that dtype: float32 SIMD lanes, no float64 promotion)
F_MARGIN, F_NEG_COEF, F_GATE, F_ONE_MINUS_GATE, F_TWO_L2, F_L2, F_SCALE, F_EPS, F_ZERO, F_ONE = (
    range(10)
)
F_LEN = 10


def float_params(margin, neg_weight, num_neg, gate, l2, scale, dtype) -> np.ndarray:
    """Pack the loss constants for :func:`run_chunk` (in the tables' dtype)."""
    fp = np.empty(F_LEN, dtype)
    fp[F_MARGIN], fp[F_NEG_COEF], fp[F_GATE] = margin, neg_weight / num_neg, gate
    fp[F_ONE_MINUS_GATE], fp[F_TWO_L2], fp[F_L2] = 1.0 - gate, 2.0 * l2, l2
    fp[F_SCALE], fp[F_EPS], fp[F_ZERO], fp[F_ONE] = scale, EPS, 0.0, 1.0
    return fp


@njit(cache=True)
def _flush_w(outW, g_buf, p_buf, n, coef):
    """outW += coef * Σ_s gh_s p_sᵀ over the n buffered samples (one small GEMM)."""
    outW += coef * np.dot(g_buf[:n].T, p_buf[:n])


@njit(cache=True, fastmath=True, nogil=True)
def run_chunk(U, V, W, hptr, hitems, users, pos, negs_in, lo, hi, seed, fp, ip, outU, outV, outW):
    """Run samples ``lo..hi-1`` on the calling thread; returns their summed loss.

    Releases the GIL, so several Python threads run disjoint chunks truly in parallel
    (Hogwild: their row updates are not synchronised, HEAT §4.1). Rows are updated in
    place as soon as their gradient is known, so with ``out* is`` the parameters an item
    drawn twice in one sample gets its second update from the already-updated row; with
    separate outputs the result is the exact gradient.

    Args (numpy, C-contiguous): ``U [n_u, K]``, ``V [n_i, K]``, ``W [K, K]`` the
    parameters read; ``hptr``/``hitems`` the history CSR; ``users``/``pos`` ``[S]`` the
    samples; ``negs_in`` ``[S, n]`` given negatives, or ``[0, n]`` to sample them;
    ``lo``/``hi`` the chunk; ``seed`` the nonzero uint64 sampler seed; ``fp`` from
    :func:`float_params`; ``ip`` = ``(n_neg, tile_size, refresh, w_sync)``;
    ``outU``/``outV``/``outW`` receive ``scale * gradient`` (they may be the parameters).

    One long function on purpose: the per-sample buffers and scalars stay local to the
    compiled loop; the body follows steps 1-4 of the module docstring in order.
    """
    margin, neg_coef, gate, one_m_g = fp[F_MARGIN], fp[F_NEG_COEF], fp[F_GATE], fp[F_ONE_MINUS_GATE]
    two_l2, l2, scale, eps = fp[F_TWO_L2], fp[F_L2], fp[F_SCALE], fp[F_EPS]
    zero, one = fp[F_ZERO], fp[F_ONE]
    n_neg, tile_size, refresh, w_sync = ip[0], ip[1], ip[2], ip[3]
    k_dim, num_items = U.shape[1], V.shape[0]
    dt = U.dtype
    h, gh, gp = np.empty(k_dim, dt), np.empty(k_dim, dt), np.empty(k_dim, dt)
    p = np.zeros(k_dim, dt)
    hist_len = np.empty(1, dt)  # typed slot: 1 / len stays in the tables' dtype
    g_buf, p_buf = np.empty((w_sync, k_dim), dt), np.empty((w_sync, k_dim), dt)
    cand = np.empty(n_neg + 1, np.int64)
    cosv, dcoef, nbv = np.empty(n_neg + 1, dt), np.empty(n_neg + 1, dt), np.empty(n_neg + 1, dt)
    state = np.empty(1, np.uint64)
    state[0] = np.uint64(seed)
    use_tile = 0 < tile_size < num_items
    tile = np.empty(max(tile_size, 1), np.int64)
    given = negs_in.shape[0] > 0
    aggregate = gate < one
    pending, loss = 0, 0.0
    for s in range(lo, hi):
        if use_tile and (s - lo) % refresh == 0:
            _refill_tile(state, tile, num_items)
        u = users[s]
        cand[0] = pos[s]
        for j in range(n_neg):
            cand[j + 1] = negs_in[s, j] if given else _draw(state, tile, use_tile, num_items)
        # behaviour aggregation: p = mean of history rows, h = g e_u + (1 - g) W p
        h0, h1 = hptr[u], hptr[u + 1]
        urow, uout = U[u], outU[u]
        if aggregate:
            p[:] = zero
            for q in range(h0, h1):
                row = V[hitems[q]]
                for e in range(k_dim):
                    p[e] += row[e]
            hist_len[0] = max(h1 - h0, 1)
            inv_len = one / hist_len[0]
            for e in range(k_dim):
                p[e] *= inv_len
            for r in range(k_dim):
                acc = zero
                for e in range(k_dim):
                    acc += W[r, e] * p[e]
                h[r] = gate * urow[r] + one_m_g * acc
        else:
            h[:] = urow
        # forward: dot products only; the same numbers feed the backward (reuse)
        a = zero
        for e in range(k_dim):
            a += h[e] * h[e]
        na = max(np.sqrt(a), eps)
        gh[:] = zero
        sum_dcos, reg = zero, zero
        for k in range(n_neg + 1):
            row = V[cand[k]]
            c, b = zero, zero
            for e in range(k_dim):
                c += h[e] * row[e]
                b += row[e] * row[e]
            nb = max(np.sqrt(b), eps)
            cs = c / (na * nb)
            if k == 0:
                d = -one
                loss += one - cs
            elif cs > margin:
                d = neg_coef
                loss += d * (cs - margin)
            else:
                d = zero
            reg += b
            cosv[k], dcoef[k], nbv[k] = cs, d, nb
            if d != zero:
                # d/dh cos(h, v) = v / (|h||v|) - cos * h / |h|^2 (HEAT eq. 4)
                f = d / (na * nb)
                for e in range(k_dim):
                    gh[e] += f * row[e]
                sum_dcos += d * cs
        if a > eps * eps:
            f = sum_dcos / a
            for e in range(k_dim):
                gh[e] -= f * h[e]
        # items: d/dv cos(h, v) = h / (|h||v|) - cos * v / |v|^2. HEAT's printed eq. 5 has
        # the opposite sign; this one is the true derivative (tests check it against autograd)
        for k in range(n_neg + 1):
            row, out = V[cand[k]], outV[cand[k]]
            d, nb = dcoef[k], nbv[k]
            c1 = scale * d / (na * nb)
            c2 = scale * two_l2
            if nb > eps:
                c2 -= scale * d * cosv[k] / (nb * nb)
            for e in range(k_dim):
                out[e] += c1 * h[e] + c2 * row[e]
        for e in range(k_dim):
            reg += urow[e] * urow[e]
        loss += l2 * reg
        if aggregate:
            # history rows: d/dp = (1 - g) gh W, shared equally by the |H_u| rows
            if h1 > h0:
                gp[:] = zero
                for r in range(k_dim):
                    g_r = gh[r]
                    for e in range(k_dim):
                        gp[e] += g_r * W[r, e]
                f = scale * one_m_g * inv_len
                for q in range(h0, h1):
                    out = outV[hitems[q]]
                    for e in range(k_dim):
                        out[e] += f * gp[e]
            # W: thread-local, flushed every w_sync samples (HEAT §4.4)
            g_buf[pending] = gh
            p_buf[pending] = p
            pending += 1
            if pending == w_sync:
                _flush_w(outW, g_buf, p_buf, pending, scale * one_m_g)
                pending = 0
        for e in range(k_dim):
            uout[e] += scale * (gate * gh[e] + two_l2 * urow[e])
    if pending > 0:
        _flush_w(outW, g_buf, p_buf, pending, scale * one_m_g)
    return loss
