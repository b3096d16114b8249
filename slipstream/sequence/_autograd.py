"""Differentiable collectives over the sequence-parallel group.

Each is an ``autograd.Function`` whose backward is the adjoint collective:

* all-to-all (scatter one dim, gather another) <-> the same all-to-all with the dims swapped
  (DeepSpeed-Ulysses, Jacobs et al. 2023, sec. 3.1);
* all-gather of equal sequence segments <-> reduce-scatter (sum) of their gradients
  (the fused K/V exchange of the LSS Transformer, Wang et al. 2023);
* sum of a scalar over the group <-> sum of its gradients (the sequence-parallel loss).

All communication goes through :mod:`slipstream.distributed.comm`, so it is byte-counted.
"""

from __future__ import annotations

from typing import Any

import torch

from slipstream.distributed import comm

__all__ = ["all_gather_segments", "all_reduce_scalar", "all_to_all_dims"]


def _a2a(x: torch.Tensor, group: comm.Group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split ``x`` into P chunks along ``scatter_dim``; chunk j goes to rank j; the chunks
    received from ranks 0..P-1 are concatenated along ``gather_dim``."""
    world = comm.get_world_size(group)
    if world == 1:
        return x
    # [.., S, ..] -> [P, .., S/P, ..]: chunk j first, contiguous for the wire (one copy).
    send = x.unflatten(scatter_dim, (world, -1)).movedim(scatter_dim, 0).contiguous()
    recv = torch.empty_like(send)
    comm.all_to_all_single(recv, send, group=group, label="sp.all_to_all")
    # [P, .., G, ..] -> [.., P*G, ..]: the source rank is the outer index of the gathered dim.
    return recv.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, group: comm.Group, scatter_dim: int, gather_dim: int
    ) -> torch.Tensor:
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return _a2a(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        return _a2a(grad, ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


def all_to_all_dims(
    x: torch.Tensor, group: comm.Group, scatter_dim: int, gather_dim: int
) -> torch.Tensor:
    """Differentiable all-to-all: ``scatter_dim`` shrinks P-fold, ``gather_dim`` grows P-fold.

    ``x.shape[scatter_dim]`` must be divisible by the group size (callers check and name the
    tensor). Communication: one all-to-all of ``x``'s bytes forward, one of the gradient's
    backward; a rank sends (P-1)/P of them.
    """
    ndim = x.dim()
    return _AllToAll.apply(x, group, scatter_dim % ndim, gather_dim % ndim)  # type: ignore[no-any-return]


class _GatherSegments(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: comm.Group, dim: int) -> torch.Tensor:  # type: ignore[override]
        ctx.group, ctx.dim = group, dim
        world = comm.get_world_size(group)
        flat = x.contiguous().reshape(-1)
        out = torch.empty(world * flat.numel(), dtype=x.dtype, device=x.device)
        comm.all_gather_into_tensor(out, flat, group=group, label="sp.lss_gather_kv")
        # [P * numel] -> [P, *x.shape] -> segments concatenated along ``dim``.
        return out.view(world, *x.shape).movedim(0, dim).flatten(dim, dim + 1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        world = comm.get_world_size(ctx.group)
        dim = ctx.dim
        # Segment j of the gradient goes to rank j, summed over every rank's contribution.
        send = grad.unflatten(dim, (world, -1)).movedim(dim, 0).contiguous()
        shard_shape = send.shape[1:]
        out = torch.empty(shard_shape.numel(), dtype=grad.dtype, device=grad.device)
        comm.reduce_scatter_tensor(out, send.reshape(-1), group=ctx.group, label="sp.lss_rs_dkv")
        return out.view(shard_shape), None, None


def all_gather_segments(x: torch.Tensor, group: comm.Group, dim: int) -> torch.Tensor:
    """Differentiable all-gather of equal segments along ``dim`` (rank order).

    Forward: one all-gather (received bytes (P-1)/P of the output). Backward: one
    reduce-scatter (sum) of the gradient, so every rank gets the sum of all ranks' gradients
    for its own segment.
    """
    if comm.get_world_size(group) == 1:
        return x
    return _GatherSegments.apply(x, group, dim % x.dim())  # type: ignore[no-any-return]


class _SumScalar(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: comm.Group) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        out = x.detach().clone()
        comm.all_reduce(out, group=group, label="sp.loss")
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        # Every rank differentiates its own copy of the group sum; the adjoint of a sum over
        # ranks is the sum of those upstream gradients (P x grad when they agree).
        grad = grad.contiguous().clone()
        comm.all_reduce(grad, group=ctx.group, label="sp.loss_grad")
        return grad, None


def all_reduce_scalar(x: torch.Tensor, group: comm.Group) -> torch.Tensor:
    """Differentiable sum of ``x`` over ``group`` (its backward is also a sum over the group)."""
    if comm.get_world_size(group) == 1:
        return x
    return _SumScalar.apply(x, group)  # type: ignore[no-any-return]
