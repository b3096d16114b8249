"""The collectives of tensor parallelism as autograd functions: one collective forward, its
adjoint backward.

Megatron's ``f`` (:func:`copy_to_tp`: identity forward, all-reduce backward) and ``g``
(:func:`reduce_from_tp`: all-reduce forward, identity backward) around column- and row-parallel
layers; under sequence parallelism the all-gather / reduce-scatter pair along the sequence
(Korthikanti et al. 2022, sec. 4.2.2). All of them go through ``slipstream.distributed.comm``
with the label ``"tp"``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from slipstream.distributed import comm

__all__ = [
    "SEQ_DIM",
    "all_gather",
    "all_reduce",
    "copy_to_tp",
    "gather_from_tp",
    "gather_seq",
    "reduce_from_tp",
    "reduce_scatter_seq",
]

SEQ_DIM = 1  # [batch, seq, hidden] activations


def _flat_front(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, list[int]]:
    """``x`` with ``dim`` moved first, contiguous and flat (fast gloo paths), and its shape."""
    moved = x.movedim(dim, 0).contiguous()
    return moved.reshape(-1), list(moved.shape)


def all_reduce(x: torch.Tensor, group: comm.Group) -> torch.Tensor:
    """The sum of ``x`` over the TP group, in a new tensor (not differentiable)."""
    out = x.contiguous().clone()
    comm.all_reduce(out, group=group, label="tp")
    return out


def all_gather(x: torch.Tensor, group: comm.Group, dim: int) -> torch.Tensor:
    """The TP ranks' ``x`` concatenated along ``dim`` in rank order (not differentiable)."""
    world = comm.get_world_size(group)
    flat, shape = _flat_front(x, dim)
    out = torch.empty(flat.numel() * world, dtype=x.dtype, device=x.device)
    comm.all_gather_into_tensor(out, flat, group=group, label="tp")
    shape[0] *= world
    return out.view(shape).movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, group: comm.Group, dim: int) -> torch.Tensor:
    world = comm.get_world_size(group)
    if x.shape[dim] % world:
        raise ValueError(
            f"tensor-parallel reduce-scatter: dimension {dim} of shape {tuple(x.shape)} is not "
            f"divisible by the TP size {world}: with sequence parallelism the sequence length "
            "must be a multiple of tensor_parallel.autotp_size"
        )
    flat, shape = _flat_front(x, dim)
    out = torch.empty(flat.numel() // world, dtype=x.dtype, device=x.device)
    comm.reduce_scatter_tensor(out, flat, group=group, label="tp")
    shape[0] //= world
    return out.view(shape).movedim(0, dim)


def _split(x: torch.Tensor, group: comm.Group, dim: int) -> torch.Tensor:
    world, rank = comm.get_world_size(group), comm.get_rank(group)
    if x.shape[dim] % world:
        raise ValueError(
            f"cannot split dimension {dim} of shape {tuple(x.shape)} over {world} "
            "tensor-parallel ranks: make it a multiple of tensor_parallel.autotp_size"
        )
    return x.chunk(world, dim)[rank].contiguous()


_Op = Callable[[torch.Tensor, comm.Group, int], torch.Tensor]
_OPS: dict[str, _Op] = {
    "identity": lambda x, group, dim: x.view_as(x),
    "all_reduce": lambda x, group, dim: all_reduce(x, group),
    "all_gather": all_gather,
    "reduce_scatter": _reduce_scatter,
    "split": _split,
}


class _Exchange(torch.autograd.Function):
    """One collective forward and its adjoint backward, e.g. Megatron's ``f`` (identity,
    all-reduce) and ``g`` (all-reduce, identity), or sequence parallelism's all-gather /
    reduce-scatter pair."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: comm.Group, dim: int, fwd: str, bwd: str
    ) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.bwd = group, dim, bwd
        return _OPS[fwd](x, group, dim)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        return _OPS[ctx.bwd](g, ctx.group, ctx.dim), None, None, None, None


def copy_to_tp(x: torch.Tensor, group: comm.Group) -> torch.Tensor:
    """Entering a column-parallel layer: identity forward, all-reduce of the gradient."""
    return _Exchange.apply(x, group, 0, "identity", "all_reduce")


def reduce_from_tp(x: torch.Tensor, group: comm.Group) -> torch.Tensor:
    """Leaving a row-parallel layer: all-reduce of the partial sums, identity backward."""
    return _Exchange.apply(x, group, 0, "all_reduce", "identity")


def gather_seq(x: torch.Tensor, group: comm.Group) -> torch.Tensor:
    """Sequence parallel, entering a column-parallel layer: all-gather the sequence, and
    reduce-scatter the gradient (each rank's columns contributed a partial sum)."""
    return _Exchange.apply(x, group, SEQ_DIM, "all_gather", "reduce_scatter")


def reduce_scatter_seq(x: torch.Tensor, group: comm.Group) -> torch.Tensor:
    """Sequence parallel, leaving a row-parallel layer: reduce-scatter the partial sums along
    the sequence, all-gather the gradient."""
    return _Exchange.apply(x, group, SEQ_DIM, "reduce_scatter", "all_gather")


def gather_from_tp(x: torch.Tensor, group: comm.Group, dim: int = -1) -> torch.Tensor:
    """All-gather ``x`` along ``dim`` over the TP group (differentiable)."""
    return _Exchange.apply(x, group, dim % x.dim(), "all_gather", "split")
