"""Typed configs of the SimpleX model and of the trainers (validated at construction)."""

from __future__ import annotations

from dataclasses import dataclass

from slipstream.config._errors import ConfigError

__all__ = ["HEATConfig", "SimpleXConfig"]


def _check(cls: str, name: str, value: float, ok: bool, rule: str) -> None:
    if not ok:
        raise ConfigError(f"{cls}.{name}={value!r} is invalid: it must be {rule}")


@dataclass(frozen=True)
class SimpleXConfig:
    """Model and loss of SimpleX (Mao et al., CIKM 2021, §3) as trained by HEAT (ICS '23, eq. 3).

    Per positive pair ``(u, i)`` with sampled negatives ``N`` the loss is
    ``(1 - cos(h_u, e_i)) + negative_weight / |N| * Σ_j max(0, cos(h_u, e_j) - margin)``
    plus ``l2 * (|e_u|² + |e_i|² + Σ_j |e_j|²)``, averaged over samples, with
    ``h_u = gate * e_u + (1 - gate) * W mean(e_j for j in history(u))``.
    """

    embedding_dim: int = 64
    """K, the width of user and item embeddings."""
    num_negatives: int = 50
    """|N|, uniformly sampled negative items per positive pair."""
    margin: float = 0.5
    """m: a negative contributes only when its cosine exceeds this."""
    negative_weight: float = 10.0
    """w: weight of the (averaged) negative term."""
    gate: float = 0.4
    """g in h_u = g e_u + (1 - g) W p_u; 1.0 is MF-CCL (no behaviour aggregation)."""
    max_history: int = 100
    """At most this many train items per user are mean-pooled into p_u."""
    l2: float = 1e-6
    """L2 weight on the embedding rows each sample touches (user, positive, negatives)."""
    init_std: float = 0.01
    """Embeddings start as N(0, init_std²); W starts Xavier-normal."""

    def __post_init__(self) -> None:
        c = "SimpleXConfig"
        _check(c, "embedding_dim", self.embedding_dim, self.embedding_dim >= 1, ">= 1")
        _check(c, "num_negatives", self.num_negatives, self.num_negatives >= 1, ">= 1")
        _check(c, "margin", self.margin, -1.0 <= self.margin < 1.0, "in [-1, 1) (a cosine)")
        _check(c, "negative_weight", self.negative_weight, self.negative_weight >= 0, ">= 0")
        _check(c, "gate", self.gate, 0.0 <= self.gate <= 1.0, "in [0, 1]")
        _check(c, "max_history", self.max_history, self.max_history >= 1, ">= 1")
        _check(c, "l2", self.l2, self.l2 >= 0, ">= 0")
        _check(c, "init_std", self.init_std, self.init_std > 0, "> 0")


@dataclass(frozen=True)
class HEATConfig:
    """How :class:`~slipstream.recsys.HEATTrainer` runs SGD (HEAT §4).

    Learning-rate semantics are per sample: every backend applies ``lr`` times the sum of
    the per-sample gradients it has seen (Hogwild SGD), so one epoch moves the model by
    the same amount whatever the thread count or ``batch_size``.
    """

    lr: float = 0.03
    """SGD step size per sample."""
    num_threads: int = 2
    """Worker threads, each running its own chunk of the samples (numba backend), or
    torch intra-op threads (torch backend)."""
    backend: str = "auto"
    """``"numba"`` (per-sample lock-free kernel, HEAT §4), ``"torch"`` (vectorized batches,
    no autograd) or ``"auto"``: numba when importable, else torch (logged once)."""
    tile_size: int = 0
    """N1 of random tiling (HEAT §4.2): negatives are drawn from a per-thread tile of this
    many items. 0 (or >= num_items) samples uniformly from all items."""
    refresh_interval: int = 1
    """N2: the tile is resampled every this many samples of a thread."""
    w_sync_interval: int = 32
    """m: each thread accumulates its W gradient locally and applies it every m samples
    (HEAT §4.4); 1 is an immediate update."""
    batch_size: int = 512
    """Samples per vectorized step of the torch backend (its staleness); unused by numba."""
    seed: int = 0
    """Seeds the epoch shuffles and every thread's negative sampler."""

    def __post_init__(self) -> None:
        c = "HEATConfig"
        _check(c, "lr", self.lr, self.lr > 0, "> 0")
        _check(c, "num_threads", self.num_threads, self.num_threads >= 1, ">= 1")
        _check(
            c, "backend", self.backend, self.backend in ("auto", "numba", "torch"),
            "one of 'auto', 'numba', 'torch'",
        )  # fmt: skip
        _check(c, "tile_size", self.tile_size, self.tile_size >= 0, ">= 0 (0 = no tiling)")
        _check(c, "refresh_interval", self.refresh_interval, self.refresh_interval >= 1, ">= 1")
        _check(c, "w_sync_interval", self.w_sync_interval, self.w_sync_interval >= 1, ">= 1")
        _check(c, "batch_size", self.batch_size, self.batch_size >= 1, ">= 1")
