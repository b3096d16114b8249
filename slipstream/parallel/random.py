"""Random-number streams for tensor parallelism.

Under tensor parallelism some random ops act on data that is *replicated* across the TP
ranks (dropout on the residual stream without sequence parallelism): their masks must be
equal on every TP rank, so they draw from the default generator, seeded identically. Others
act on data that is *split* across the TP ranks (attention-probability dropout on the local
heads; residual dropout on the local sequence chunk under sequence parallelism): their masks
must differ, or the TP ranks would drop the same pattern in every shard. Those ops run
inside ``get_rng_tracker().fork()``, which swaps in a per-TP-rank generator state and puts
the default one back afterwards (the default stream does not advance).

The tracker holds states, not generators, so activation recomputation
(``slipstream.parallel.recompute``) can save and restore them around a recompute and dropout
masks are reproduced exactly.

Whose tracker: a tracker is an explicit object. ``slipstream.initialize`` gives each engine
with tensor parallelism its own, which its TP plan and its recompute context share, so two
engines in one process never draw from (or reseed) each other's streams. The process-wide
instance returned by :func:`get_rng_tracker` is the default for code that uses the
DeepSpeed/Megatron module-level API (``get_cuda_rng_tracker()``,
``model_parallel_cuda_manual_seed``) and for ``parallelize_tp_`` called without a tracker.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from slipstream.accelerator import get_accelerator

__all__ = [
    "MODEL_PARALLEL_RNG",
    "RNGStatesTracker",
    "get_rng_tracker",
    "model_parallel_manual_seed",
]

MODEL_PARALLEL_RNG = "model-parallel-rng"
_TP_SEED_OFFSET = 2718  # keeps the per-rank streams away from the default seed


def _get_state() -> torch.Tensor:
    """The generator state of the training device (the CPU generator on a CPU)."""
    return get_accelerator().get_rng_state()


def _set_state(state: torch.Tensor) -> None:
    get_accelerator().set_rng_state(state)


class RNGStatesTracker:
    """Named generator states; ``fork(name)`` runs a block on one of them."""

    def __init__(self) -> None:
        self._states: dict[str, torch.Tensor] = {}
        self._seeds: set[int] = set()

    def reset(self) -> None:
        self._states.clear()
        self._seeds.clear()

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of every stream's state (for checkpointing and recompute)."""
        return {name: state.clone() for name, state in self._states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._states = {name: state.clone() for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        """Create stream ``name`` seeded with ``seed`` (each name and seed used once)."""
        if name in self._states:
            raise ValueError(f"RNG stream {name!r} already exists: call reset() first")
        if seed in self._seeds:
            raise ValueError(
                f"seed {seed} already seeds another RNG stream: give {name!r} its own seed"
            )
        saved = _get_state()
        get_accelerator().manual_seed(seed)
        self._states[name] = _get_state()
        _set_state(saved)
        self._seeds.add(seed)

    def has(self, name: str) -> bool:
        return name in self._states

    @contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Run the block drawing from stream ``name``; the default stream is untouched."""
        if name not in self._states:
            raise KeyError(
                f"RNG stream {name!r} was never added: call "
                "slipstream.parallel.random.model_parallel_manual_seed(seed) first (initialize "
                "seeds the tracker of each engine with tensor parallelism)"
            )
        saved = _get_state()
        _set_state(self._states[name])
        try:
            yield
        finally:
            self._states[name] = _get_state()
            _set_state(saved)


_DEFAULT_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The process-wide default tracker (Megatron's ``get_cuda_rng_tracker``)."""
    return _DEFAULT_TRACKER


def model_parallel_manual_seed(
    seed: int, tp_rank: int = 0, tracker: RNGStatesTracker | None = None
) -> RNGStatesTracker:
    """Seed the default stream with ``seed`` (equal on all TP ranks) and the tensor-parallel
    stream of ``tracker`` (default: the process-wide one) with ``seed + 2718 + tp_rank``
    (different on each TP rank). Returns the tracker."""
    tracker = tracker if tracker is not None else _DEFAULT_TRACKER
    torch.manual_seed(seed)
    tracker.reset()
    tracker.add(MODEL_PARALLEL_RNG, seed + _TP_SEED_OFFSET + tp_rank)
    return tracker
