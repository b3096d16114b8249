"""``deepspeed.utils.safe_get_full_*`` / ``safe_set_full_*``: whole fp32 values of a parameter.

Under ZeRO a parameter's fp32 master, its reduced gradient and its optimizer states are split
across the data-parallel ranks (stage 1-3; stage 0 keeps them whole). These helpers assemble
the whole tensor from every rank's piece, or write a whole tensor back into every rank's piece.
They are collective like DeepSpeed's: every data-parallel rank must call them with the same
parameter (and, for the setters, the same value). A parameter no ZeRO optimizer updates (a
frozen one, or before ``initialize``) gives None, as in DeepSpeed.

Cost: one all-reduce of the parameter's size over the data-parallel group when its pieces
are spread over ranks; none at stage 0 or for the setters.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from slipstream.distributed import comm
from slipstream.zero.holdings import BucketShard
from slipstream.zero.optimizer import ZeroOptimizer, owner_of

__all__ = [
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
]


def _assemble(opt: ZeroOptimizer, b: int, full: torch.Tensor) -> torch.Tensor:
    """Sum the per-rank pieces of bucket ``b`` (each element is held by exactly one rank of
    the bucket's group, the rest are 0): an expert bucket is sharded over its expert-data-
    parallel group only (the other ranks hold other experts)."""
    if opt.partition:
        group = opt.buckets[b].comm_group(opt.group)
        comm.all_reduce(full, group=group, label="safe_get_full")
    return full


def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """The whole fp32 master weight of ``param`` (its shape), from every rank's shard."""
    found = owner_of(param)
    if found is None:
        return None
    opt, b, i = found
    with opt.bucket_shard(b) as shard:
        shape = shard.bucket.shapes[i]
        mine = shard.bucket.param_slice(i, *shard.owned)
        full = torch.zeros(shape.numel(), dtype=shard.master.dtype, device=shard.master.device)
        if mine:
            full[mine.param] = shard.master[mine.at(shard.owned[0])]
    return _assemble(opt, b, full).view(shape)


def safe_get_full_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The whole data-parallel-averaged gradient of ``param`` after ``engine.backward`` at an
    accumulation boundary, before ``engine.step`` (in the gradient accumulation dtype and,
    under fp16, still multiplied by the loss scale, as DeepSpeed's)."""
    found = owner_of(param)
    if found is None:
        return None
    opt, b, i = found
    opt.finish_backward()
    grad = opt.owned_grad(b)
    bucket = opt.buckets[b]
    lo, hi = opt.owned_range(b)
    mine = bucket.param_slice(i, lo, hi)
    full = torch.zeros(bucket.shapes[i].numel(), dtype=grad.dtype, device=grad.device)
    if mine:
        full[mine.param] = grad[mine.at(lo)]
    return _assemble(opt, b, full).view(bucket.shapes[i])


def _state_pieces(
    opt: ZeroOptimizer, shard: BucketShard, i: int, key: str
) -> Iterator[tuple[slice, torch.Tensor]]:
    """(slice of the flat parameter, the state tensor) for this rank's views of parameter
    ``i`` that hold state ``key``."""
    for piece in shard.pieces:
        if piece.index != i:
            continue
        value = opt.state.get(piece.view, {}).get(key)
        if isinstance(value, torch.Tensor) and value.numel() == piece.view.numel():
            yield piece.extent.param, value.view(-1)


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    """The whole optimizer state ``optim_state_key`` (e.g. ``"exp_avg"``) of ``param``; None
    if the optimizer keeps no such per-element state (before the first step, or a bad key)."""
    found = owner_of(param)
    if found is None:
        return None
    opt, b, i = found
    with opt.bucket_shard(b) as shard:
        shape = shard.bucket.shapes[i]
        pieces = list(_state_pieces(opt, shard, i, optim_state_key))
        ref = pieces[0][1] if pieces else shard.master
        # One extra element counts the ranks that hold the state, in the same collective.
        full = torch.zeros(shape.numel() + 1, dtype=ref.dtype, device=ref.device)
        for where, value in pieces:
            full[where] = value
        full[-1] = 1.0 if pieces else 0.0
    full = _assemble(opt, b, full)
    if full[-1].item() == 0:
        return None
    return full[:-1].view(shape)


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set ``param``'s fp32 master and its training-dtype copy to ``value`` (its full shape).

    Every rank writes its own piece from the same ``value``, so no communication is needed;
    the model sees the new weight at the next forward.
    """
    found = owner_of(param)
    if found is None:
        raise ValueError(
            f"safe_set_full_fp32_param: this parameter (shape {tuple(param.shape)}) is not "
            "updated by a ZeRO optimizer (frozen, or called before initialize); set it directly"
        )
    opt, b, i = found
    flat = _checked(value, opt.buckets[b].shapes[i], "safe_set_full_fp32_param").reshape(-1)
    with torch.no_grad(), opt.bucket_shard(b) as shard:
        bucket = shard.bucket
        owned = bucket.param_slice(i, *shard.owned)
        if owned:
            shard.master[owned.at(shard.owned[0])] = flat[owned.param]
        # What this rank stores of the parameter: all of it at stages 0-2, its shard at 3.
        held = bucket.param_slice(i, *shard.held)
        if held:
            shard.params[held.at(shard.held[0])] = flat[held.param]


def safe_set_full_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Replace ``param``'s reduced gradient with ``value`` (its full shape, in the gradient
    accumulation dtype) after ``engine.backward`` at an accumulation boundary, before
    ``engine.step``: the step then applies ``value``. Every rank writes its own piece from
    the same ``value`` (no communication), as with DeepSpeed's.

    Raises:
        ValueError: ``param`` is not updated by a ZeRO optimizer, or ``value`` has another shape.
    """
    found = owner_of(param)
    if found is None:
        raise ValueError(
            f"safe_set_full_grad: this parameter (shape {tuple(param.shape)}) is not updated "
            "by a ZeRO optimizer (frozen, or called before initialize); set its .grad directly"
        )
    opt, b, i = found
    opt.finish_backward()
    grad = opt.owned_grad(b)
    bucket = opt.buckets[b]
    flat = _checked(value, bucket.shapes[i], "safe_set_full_grad").reshape(-1)
    lo, hi = opt.owned_range(b)
    mine = bucket.param_slice(i, lo, hi)
    if mine:
        with torch.no_grad():
            grad[mine.at(lo)] = flat[mine.param].to(grad.dtype)


def safe_set_full_optimizer_state(
    param: torch.Tensor, value: torch.Tensor, optim_state_key: str
) -> None:
    """Set ``param``'s optimizer state ``optim_state_key`` to ``value`` (its full shape).

    Raises:
        KeyError: the optimizer holds no such state for this parameter yet (states appear
            at the first step).
    """
    found = owner_of(param)
    if found is None:
        raise ValueError(
            "safe_set_full_optimizer_state: this parameter is not updated by a ZeRO optimizer"
        )
    opt, b, i = found
    flat = _checked(value, opt.buckets[b].shapes[i], "safe_set_full_optimizer_state").reshape(-1)
    with torch.no_grad(), opt.bucket_shard(b) as shard:
        pieces = list(_state_pieces(opt, shard, i, optim_state_key))
        if shard.bucket.param_slice(i, *shard.owned) and not pieces:
            raise KeyError(
                f"optimizer state '{optim_state_key}' does not exist for this parameter: states "
                "are created by the first optimizer step (exp_avg/exp_avg_sq for Adam)"
            )
        for where, target in pieces:
            target.copy_(flat[where])


def _checked(value: torch.Tensor, shape: torch.Size, fn: str) -> torch.Tensor:
    if tuple(value.shape) != tuple(shape):
        raise ValueError(
            f"{fn}: value has shape {tuple(value.shape)} but the parameter has shape "
            f"{tuple(shape)}; pass the full (unpartitioned) tensor"
        )
    return value.detach()
