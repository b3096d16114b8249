"""What one rank holds of a bucket, as ``ZeroOptimizer.bucket_shard`` hands it out to the
checkpoint code and ``deepspeed.utils``' ``safe_get/set_full_*``: the parameter values it
stores, the master weights of the region it updates and the tensors its inner optimizer
keys states by, each with its place in the bucket (:class:`~slipstream.zero.flat.FlatSlice`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slipstream.zero.flat import Bucket, FlatSlice

__all__ = ["BucketShard", "StatePiece"]


@dataclass(frozen=True)
class StatePiece:
    """A tensor the inner optimizer updates: a slice of this rank's master weights that lies
    inside one parameter.

    Attributes:
        view: the inner optimizer's parameter (its states are ``optimizer.state[view]``).
        index: the parameter's index in its bucket.
        extent: where ``view`` lies in the bucket (``extent.param``: in the parameter).
    """

    view: torch.Tensor
    index: int
    extent: FlatSlice


@dataclass(frozen=True)
class BucketShard:
    """One bucket as this rank holds it: what a checkpoint writes and loads.

    Attributes:
        bucket: the layout (parameter names, shapes, offsets).
        held: the ``[start, stop)`` bucket elements of ``params``.
        params: the parameter values this rank stores between steps: the whole bucket at
            stages 0-2, this rank's shard at stage 3.
        owned: the ``[start, stop)`` bucket elements this rank updates (inside ``held``).
        master: the master weights of ``owned``.
        separate_master: ``master`` is a copy (another dtype, or offloaded), not the
            parameter storage itself.
        pieces: the tensors the inner optimizer updates, in order.
        transient: the master and states are freed when the block ends (NVMe offload swaps
            them out): copy what must outlive it.
    """

    bucket: Bucket
    held: tuple[int, int]
    params: torch.Tensor
    owned: tuple[int, int]
    master: torch.Tensor
    separate_master: bool
    pieces: list[StatePiece]
    transient: bool
