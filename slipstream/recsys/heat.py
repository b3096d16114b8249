"""HEAT trainer (Zhang et al., ICS '23): multi-threaded CPU SGD for SimpleX / MF-CCL.

:class:`HEATTrainer` trains a :class:`~slipstream.recsys.model.SimpleX` in place. Its
default backend is a numba kernel (per-sample, lock-free Hogwild SGD over thread-owned
chunks of the shuffled samples) implementing HEAT's three optimizations:

- **random tiling** of the negative-sampling space per thread (§4.2, ``tile_size`` and
  ``refresh_interval``);
- **vector products per sample** instead of gathered/concatenated/normalised batches (§4.3);
- **reuse of forward dot products** in the closed-form backward (§4.3), with sparse
  in-place row updates and thread-local W accumulation (§4.4).

The ``torch`` backend does the same math as vectorized batches without autograd.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np
import torch

from slipstream.recsys.config import HEATConfig
from slipstream.recsys.model import SimpleX

__all__ = ["HEATTrainer", "numba_available"]

logger = logging.getLogger(__name__)


def numba_available() -> bool:
    """True when the numba backend can be used (``pip install numba``)."""
    return importlib.util.find_spec("numba") is not None


def _resolve_backend(name: str) -> str:
    if name == "auto":
        chosen = "numba" if numba_available() else "torch"
        if chosen == "torch":
            logger.warning(
                "HEATTrainer: numba is not installed, using the (much slower) torch backend; "
                "`pip install numba` for the HEAT kernel"
            )
        return chosen
    if name == "numba" and not numba_available():
        raise ImportError(
            "HEATConfig.backend='numba' needs numba, which is not installed; "
            "`pip install numba` or set backend='torch'"
        )
    return name


@contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    prev = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


class HEATTrainer:
    """Trains ``model`` in place with HEAT's per-sample SGD on ``train`` pairs.

    Args:
        model: a CPU :class:`SimpleX` (float32 or float64 parameters).
        train: ``[n, 2]`` int64 ``(user, item)`` positive pairs.
        config: optimizer, threads, backend, tiling (:class:`HEATConfig`).

    One epoch visits every pair once in a fresh random order, split into one contiguous
    chunk per thread; negatives come from each thread's own sampler (uniform or tiled,
    seeded by ``(seed, epoch, thread)``). Updates are lock-free, so with more than one
    thread results vary slightly from run to run (as in HEAT). Memory beyond the model is
    O(threads · (K² + w_sync_interval · K)). The first numba call compiles the kernel
    for the parameter dtype (tens of seconds, cached on disk afterwards).
    """

    def __init__(self, model: SimpleX, train: np.ndarray, config: HEATConfig | None = None):
        self.config = config = config or HEATConfig()
        self.model = model
        self.backend = _resolve_backend(config.backend)
        params = (model.user_emb, model.item_emb, model.W)
        if any(p.device.type != "cpu" or not p.is_contiguous() for p in params):
            raise ValueError(
                "HEATTrainer needs a CPU model with contiguous parameters; call .cpu()"
            )
        if len({p.dtype for p in params}) != 1 or params[0].dtype not in (
            torch.float32,
            torch.float64,
        ):
            raise ValueError(
                f"HEATTrainer needs float32 or float64 parameters of one dtype, got "
                f"{[p.dtype for p in params]}; call model.float()"
            )
        train = np.ascontiguousarray(train, dtype=np.int64)
        if train.ndim != 2 or train.shape[1] != 2 or len(train) == 0:
            raise ValueError(f"train must be a non-empty [n, 2] array, got {train.shape}")
        if train[:, 0].max() >= model.num_users or train[:, 1].max() >= model.num_items:
            raise ValueError("train has user/item ids beyond the model's num_users/num_items")
        self.train = train
        self.epoch = 0
        self._pool: ThreadPoolExecutor | None = None

    # -- public ---------------------------------------------------------------------------
    def train_epoch(self) -> float:
        """One pass over the train pairs; returns the mean per-sample loss (before updates)."""
        cfg = self.config
        order = np.random.default_rng([cfg.seed, self.epoch]).permutation(len(self.train))
        users = np.ascontiguousarray(self.train[order, 0])
        pos = np.ascontiguousarray(self.train[order, 1])
        with torch.no_grad():
            if self.backend == "numba":
                total = self._numba(users, pos, None, -cfg.lr, self._params(), cfg.num_threads)
            else:
                with _torch_threads(cfg.num_threads):
                    total = self._torch_epoch(users, pos)
        self.epoch += 1
        return total / len(users)

    def step(self, users: torch.Tensor, pos: torch.Tensor, negs: torch.Tensor) -> float:
        """Apply HEAT SGD to the given samples, in order, with the given negatives
        (``[B]``, ``[B]``, ``[B, num_negatives]`` int64); returns their mean loss.

        The numba backend runs them as one chunk on one thread (per-sample updates, W
        flushed every ``w_sync_interval`` samples and at the end); the torch backend as
        one vectorized batch."""
        arrays = self._check_samples(users, pos, negs)
        with torch.no_grad():
            if self.backend == "numba":
                total = self._numba(*arrays, -self.config.lr, self._params(), 1)
            else:
                total = self._torch_step(users, pos, negs, -self.config.lr, self._params())
        return total / len(arrays[0])

    def gradients(
        self, users: torch.Tensor, pos: torch.Tensor, negs: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Mean gradient of the loss over the given samples, by this backend's closed form,
        without changing the model: ``{"user_emb", "item_emb", "W"}`` -> tensors shaped
        like the parameters (compare with autograd on :meth:`SimpleX.loss`)."""
        users_np, pos_np, negs_np = self._check_samples(users, pos, negs)
        outs = tuple(torch.zeros_like(p) for p in self._params())
        scale = 1.0 / len(users_np)
        with torch.no_grad():
            if self.backend == "numba":
                self._numba(users_np, pos_np, negs_np, scale, outs, 1, w_sync=len(users_np))
            else:
                self._torch_step(users, pos, negs, scale, outs)
        return dict(zip(("user_emb", "item_emb", "W"), outs))

    def close(self) -> None:
        """Stop the worker threads of the numba backend (a later epoch starts them again)."""
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def _check_samples(
        self, users: torch.Tensor, pos: torch.Tensor, negs: torch.Tensor
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        m = self.model
        n = m.config.num_negatives
        if users.ndim != 1 or pos.shape != users.shape or negs.shape != (len(users), n):
            raise ValueError(
                f"samples must be users [B], pos [B], negs [B, num_negatives={n}], got "
                f"{tuple(users.shape)}, {tuple(pos.shape)}, {tuple(negs.shape)}"
            )
        for name, t, hi in (("users", users, m.num_users), ("pos", pos, m.num_items),
                            ("negs", negs, m.num_items)):  # fmt: skip
            if t.numel() and (int(t.min()) < 0 or int(t.max()) >= hi):
                raise ValueError(
                    f"{name} ids must be in [0, {hi}), got [{int(t.min())}, {int(t.max())}]"
                )
        return tuple(np.ascontiguousarray(t.numpy(), np.int64) for t in (users, pos, negs))  # type: ignore[return-value]

    # -- backends -------------------------------------------------------------------------
    def _params(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        m = self.model
        return m.user_emb.data, m.item_emb.data, m.W.data

    def _numba(self, users, pos, negs, scale, outs, n_chunks, w_sync=None) -> float:
        from slipstream.recsys._numba_kernels import float_params, run_chunk

        cfg, mcfg = self.config, self.model.config
        U, V, W = (p.numpy() for p in self._params())
        oU, oV, oW = (o.numpy() for o in outs)
        k = mcfg.num_negatives
        negs_in = negs if negs is not None else np.empty((0, k), np.int64)
        bounds = np.linspace(0, len(users), n_chunks + 1).astype(np.int64)
        seeds = np.random.SeedSequence([cfg.seed, self.epoch]).generate_state(n_chunks, np.uint64)
        fp = float_params(mcfg.margin, mcfg.negative_weight, k, mcfg.gate, mcfg.l2, scale, U.dtype)
        ip = np.array([k, cfg.tile_size, cfg.refresh_interval, w_sync or cfg.w_sync_interval])
        hist = (self.model.hist_indptr, self.model.hist_items)

        def chunk(t: int) -> float:
            lo, hi, seed = bounds[t], bounds[t + 1], seeds[t] | np.uint64(1)
            return run_chunk(U, V, W, *hist, users, pos, negs_in, lo, hi, seed, fp, ip, oU, oV, oW)

        if n_chunks == 1:
            return float(chunk(0))
        if self._pool is None:
            self._pool = ThreadPoolExecutor(cfg.num_threads, thread_name_prefix="heat")
        # run_chunk releases the GIL: the chunks run in parallel, lock-free (Hogwild)
        return float(sum(self._pool.map(chunk, range(n_chunks))))

    def _torch_step(self, users, pos, negs, scale, outs) -> float:
        from slipstream.recsys._torch_kernels import torch_heat_step

        m = self.model
        history = (m.hist_pad, m.hist_mask)
        return torch_heat_step(self._params(), history, (users, pos, negs), m.config, scale, outs)

    def _torch_epoch(self, users_np: np.ndarray, pos_np: np.ndarray) -> float:
        cfg, m = self.config, self.model
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + self.epoch)
        users, pos = torch.from_numpy(users_np), torch.from_numpy(pos_np)
        sampler = _TorchSampler(m.num_items, cfg.tile_size, cfg.refresh_interval, gen)
        total = 0.0
        for start in range(0, len(users), cfg.batch_size):
            u = users[start : start + cfg.batch_size]
            negs = sampler.draw(len(u), m.config.num_negatives)
            total += self._torch_step(
                u, pos[start : start + cfg.batch_size], negs, -cfg.lr, self._params()
            )
        return total


class _TorchSampler:
    """Uniform or tiled negatives for the torch backend (tile refreshed every ``refresh``
    samples, counted in whole batches)."""

    def __init__(self, num_items: int, tile_size: int, refresh: int, gen: torch.Generator):
        self.num_items, self.tile_size, self.refresh, self.gen = num_items, tile_size, refresh, gen
        self.tile: torch.Tensor | None = None
        self.since = 0

    def draw(self, batch: int, num_neg: int) -> torch.Tensor:
        if not 0 < self.tile_size < self.num_items:
            return torch.randint(0, self.num_items, (batch, num_neg), generator=self.gen)
        if self.tile is None or self.since >= self.refresh:
            self.tile = torch.randint(0, self.num_items, (self.tile_size,), generator=self.gen)
            self.since = 0
        self.since += batch
        return self.tile[torch.randint(0, self.tile_size, (batch, num_neg), generator=self.gen)]
