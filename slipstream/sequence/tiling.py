"""Memory tiling over the sequence: run a token-wise computation in chunks, recompute in backward.

Arctic Long Sequence Training (ALST; Bekman et al. 2025, "Arctic Long Sequence Training:
Scalable And Efficient Training For Multi-Million Token Sequences", section 3.2) observes that
at long sequence lengths the largest activations are not attention's but the MLP's
``[S, intermediate]`` intermediates and the ``[S, vocab]`` logits of the loss. Both are
token-wise, so they can be computed a chunk of tokens at a time:

* :class:`TiledMLP`: the MLP's output chunk by chunk; nothing but its input is kept for
  backward, which recomputes each chunk and backpropagates it before the next;
* :class:`TiledFusedLogitsLoss`: the output projection and the loss chunk by chunk, so the
  ``[S, vocab]`` logits never exist (at most one chunk of them does);
* :func:`sequence_tiled_compute` / :class:`SequenceTiledCompute`: the same for any function of
  ``[B, S, ...]`` tensors (DeepSpeed's generic form).

The names and the ``apply`` signatures are DeepSpeed 0.19.8's
(``deepspeed.runtime.sequence_parallel.ulysses_sp``), so ALST scripts run unchanged. One
difference, for correctness under any gradient reducer: DeepSpeed accumulates each chunk's
parameter gradients into ``.grad`` with nested ``backward`` calls and flags ZeRO's
``ds_grad_is_ready`` to delay the reduction to the last chunk. Here each chunk's gradients are
taken with ``torch.autograd.grad``, summed, and returned from ``backward`` for the parameters,
which are inputs of the autograd function: every parameter receives its gradient once per
backward pass through the ordinary autograd path, so ZeRO 1-3, DDP and FSDP see nothing
special. Consequently the parameters must hold their values when ``apply`` runs (always true
outside ZeRO-3; under ZeRO-3 call it inside the owning module's forward, which is what
:mod:`slipstream.sequence.hf_tiling` does) and every parameter the function reads must be
passed in ``compute_params`` or belong to ``self`` (a gradient flowing to any other parameter
is an error naming it, never silently dropped).

Memory: the forward keeps only its inputs; the backward holds one chunk's intermediates, the
input gradient and one gradient buffer per parameter. Cost: the forward runs twice (three
times under activation checkpointing), except in :class:`TiledFusedLogitsLoss`, which
recomputes too (it returns no intermediate, so nothing else is kept).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

__all__ = [
    "SequenceTiledCompute",
    "TiledFusedLogitsLoss",
    "TiledMLP",
    "sequence_tiled_compute",
]


def _params_of(compute_params: Iterable[torch.Tensor] | None, owner: Any) -> list[torch.Tensor]:
    """The trainable tensors whose gradients the tiled function returns: ``compute_params``
    and, when ``owner`` is a module, its parameters (deduplicated, in order)."""
    found: dict[int, torch.Tensor] = {}
    for p in list(compute_params or []) + (
        list(owner.parameters()) if isinstance(owner, nn.Module) else []
    ):
        if isinstance(p, torch.Tensor) and p.requires_grad:
            found.setdefault(id(p), p)
    params = list(found.values())
    for p in params:
        if p.numel() == 0:
            raise ValueError(
                f"tiled compute: a parameter of shape {tuple(p.shape)} holds no values (a "
                "ZeRO-3 parameter released outside its module's forward). Call the tiled "
                "function inside the forward of the module that owns the parameters (the "
                "config's tiled_compute switches do), or gather them first"
            )
    return params


def _check_no_stray_params(outputs: Sequence[torch.Tensor], known: list[torch.Tensor]) -> None:
    """Raise if the recomputed graph reaches a trainable leaf not among ``known``: its
    gradient would be lost."""
    ids = {id(t) for t in known}
    seen: set[int] = set()
    stack = [o.grad_fn for o in outputs if o.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        leaf = getattr(node, "variable", None)
        if leaf is not None and id(leaf) not in ids and leaf.requires_grad:
            raise ValueError(
                f"tiled compute: the function reads a trainable tensor of shape "
                f"{tuple(leaf.shape)} that is neither in compute_params nor a parameter of "
                "the module passed as `self`; its gradient would be lost. Add it to "
                "compute_params"
            )
        stack.extend(n for n, _ in node.next_functions if n is not None)


class _ChunkGrads:
    """Gradient accumulators of one tiled backward: the chunked input's gradient, written
    chunk by chunk into one buffer, and one summed buffer per parameter."""

    def __init__(self, x: torch.Tensor, params: list[torch.Tensor], need_x: bool) -> None:
        self.x = torch.zeros_like(x) if need_x else None
        self.params: list[torch.Tensor | None] = [None] * len(params)
        self.param_refs = params
        self.checked = False

    def run(
        self,
        outputs: torch.Tensor,
        grad_outputs: torch.Tensor | None,
        x_chunk: torch.Tensor,
        x_slot: torch.Tensor | None,
    ) -> None:
        """Backpropagate one recomputed chunk: its input gradient into ``x_slot`` (a view of
        the input-gradient buffer), its parameter gradients added to the sums."""
        if not self.checked:
            _check_no_stray_params([outputs], [x_chunk, *self.param_refs])
            self.checked = True
        wrt = ([x_chunk] if x_slot is not None else []) + self.param_refs
        if not wrt or not outputs.requires_grad:
            return
        grads = torch.autograd.grad(outputs, wrt, grad_outputs, allow_unused=True)
        if x_slot is not None:
            if grads[0] is not None:
                x_slot.copy_(grads[0])
            grads = grads[1:]
        for i, g in enumerate(grads):
            if g is None:
                continue
            acc = self.params[i]
            self.params[i] = g if acc is None else acc.add_(g)


class TiledMLP(torch.autograd.Function):
    """A token-wise module (an MLP) over chunks of tokens, recomputed chunk by chunk in backward.

    ``TiledMLP.apply(fn, self, x, shards, compute_params)`` returns ``fn(self, x)``
    computed on ``shards`` chunks of the tokens of ``x`` (``[..., tokens, hidden]``; all
    leading dimensions are tokens too). ``fn`` must treat tokens independently (true of
    every transformer MLP). Gradients flow to ``x``, to ``compute_params`` and to the
    parameters of ``self`` (when it is a module).

    Memory: the ``[tokens, intermediate]`` intermediates of one chunk at a time, forward and
    backward; ``x`` is kept for backward (the untiled MLP keeps it too). Cost: ``fn`` runs
    twice.
    """

    @classmethod
    def apply(  # type: ignore[override]
        cls,
        fn: Callable[[Any, torch.Tensor], torch.Tensor],
        self: Any,
        x: torch.Tensor,
        shards: int,
        compute_params: Iterable[torch.Tensor] | None,
    ) -> torch.Tensor:
        if int(shards) < 1:
            raise ValueError(f"TiledMLP: shards={shards}, must be at least 1")
        params = _params_of(compute_params, self)
        return super().apply(fn, self, x, int(shards), len(params), *params)  # type: ignore[no-any-return]

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        fn: Callable[[Any, torch.Tensor], torch.Tensor],
        self: Any,
        x: torch.Tensor,
        shards: int,
        n_params: int,
        *params: torch.Tensor,
    ) -> torch.Tensor:
        ctx.fn, ctx.owner, ctx.shards = fn, self, shards
        # The parameters themselves, not saved copies: under a non-reentrant checkpoint the
        # saved tensors come back as other objects, and the gradients must reach these.
        ctx.params = list(params)
        ctx.save_for_backward(x)
        flat = x.reshape(-1, x.shape[-1])
        with torch.no_grad():
            out = [fn(self, chunk) for chunk in torch.chunk(flat, shards, dim=0)]
        return torch.cat(out, dim=0).reshape(*x.shape[:-1], out[0].shape[-1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        params = ctx.params
        flat = x.detach().reshape(-1, x.shape[-1])
        grad = grad.reshape(flat.shape[0], -1)
        acc = _ChunkGrads(flat, params, ctx.needs_input_grad[2])
        start = 0
        for chunk in torch.chunk(flat, ctx.shards, dim=0):
            n = chunk.shape[0]
            leaf = chunk.detach().requires_grad_(acc.x is not None)
            with torch.enable_grad():
                out = ctx.fn(ctx.owner, leaf)
            slot = acc.x.narrow(0, start, n) if acc.x is not None else None
            acc.run(out, grad.narrow(0, start, n), leaf, slot)
            start += n
        x_grad = acc.x.reshape(x.shape) if acc.x is not None else None
        return (None, None, x_grad, None, None, *acc.params)


class TiledFusedLogitsLoss(torch.autograd.Function):
    """A loss over chunks of tokens that never materializes the whole logits.

    ``TiledFusedLogitsLoss.apply(fn, self, x, y, mask, shards, compute_params,
    output_reduction)`` returns the ``output_reduction`` ("mean" or "sum") over ``shards``
    chunks of ``fn(self, x_chunk, y_chunk[, mask_chunk])``, where ``x [B, S, ...]`` (the
    hidden states), ``y [B, S, ...]`` (the targets) and the optional ``mask [B, S]`` are cut
    into chunks of the flattened ``B*S`` tokens. ``fn`` is typically ``lm_head`` plus a
    cross-entropy returning a scalar. "mean" is the mean of the per-chunk values (as in
    DeepSpeed), which is the token mean only when every chunk has the same number of
    counted tokens: prefer "sum" of token-loss sums, divided by the token count.

    Memory: one chunk's logits at a time, forward and backward. Cost: ``fn`` runs twice.
    Gradients flow to ``x``, ``compute_params`` and the parameters of ``self``.

    Raises:
        ValueError: an unknown reduction, ``x``/``y``/``mask`` of mismatched ``[B, S]``.
    """

    @classmethod
    def apply(  # type: ignore[override]
        cls,
        fn: Callable[..., torch.Tensor],
        self: Any,
        x: torch.Tensor,
        y: torch.Tensor,
        mask: torch.Tensor | None,
        shards: int,
        compute_params: Iterable[torch.Tensor] | None,
        output_reduction: str,
    ) -> torch.Tensor:
        if output_reduction not in ("mean", "sum"):
            raise ValueError(
                f'unknown reduction {output_reduction}: valid values are: "mean"/"sum"'
            )
        if x.dim() < 2 or y.dim() < 2:
            raise ValueError("x and y must be at least 2D [batch_size, seq_len, ...]")
        if x.shape[:2] != y.shape[:2]:
            raise ValueError(
                f"x and y batch/seq dims must match: {tuple(x.shape)} vs {tuple(y.shape)}"
            )
        if mask is not None and tuple(mask.shape) != tuple(x.shape[:2]):
            raise ValueError(
                f"mask must be [batch_size, seq_len] = {tuple(x.shape[:2])}, got "
                f"{tuple(mask.shape)}"
            )
        if int(shards) < 1:
            raise ValueError(f"TiledFusedLogitsLoss: shards={shards}, must be at least 1")
        params = _params_of(compute_params, self)
        return super().apply(  # type: ignore[no-any-return]
            fn, self, x, y, mask, int(shards), output_reduction, len(params), *params
        )

    @staticmethod
    def _chunks(ctx: Any, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None) -> Any:
        tokens = x.shape[0] * x.shape[1]
        xs = torch.chunk(x.reshape(tokens, *x.shape[2:]), ctx.shards, dim=0)
        ys = torch.chunk(y.reshape(tokens, *y.shape[2:]), ctx.shards, dim=0)
        ms: Sequence[torch.Tensor | None] = (
            torch.chunk(mask.reshape(-1), ctx.shards, dim=0)
            if mask is not None
            else [None] * len(xs)
        )
        return zip(xs, ys, ms)

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        fn: Callable[..., torch.Tensor],
        self: Any,
        x: torch.Tensor,
        y: torch.Tensor,
        mask: torch.Tensor | None,
        shards: int,
        output_reduction: str,
        n_params: int,
        *params: torch.Tensor,
    ) -> torch.Tensor:
        ctx.fn, ctx.owner, ctx.shards, ctx.reduction = fn, self, shards, output_reduction
        ctx.has_mask = mask is not None
        ctx.params = list(params)  # see TiledMLP.forward
        ctx.save_for_backward(x, y, *([mask] if mask is not None else []))
        with torch.no_grad():
            parts = [
                fn(self, xc, yc, *([mc] if mc is not None else []))
                for xc, yc, mc in TiledFusedLogitsLoss._chunks(ctx, x, y, mask)
            ]
        stacked = torch.stack([p.reshape(()) for p in parts])
        return stacked.mean() if output_reduction == "mean" else stacked.sum()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        saved = list(ctx.saved_tensors)
        x, y = saved[0], saved[1]
        mask = saved[2] if ctx.has_mask else None
        params = ctx.params
        chunks = list(TiledFusedLogitsLoss._chunks(ctx, x.detach(), y, mask))
        # Each chunk's value enters the result with weight 1 (sum) or 1/chunks (mean).
        weight = grad / len(chunks) if ctx.reduction == "mean" else grad
        acc = _ChunkGrads(x.reshape(-1, *x.shape[2:]), params, ctx.needs_input_grad[2])
        start = 0
        for xc, yc, mc in chunks:
            n = xc.shape[0]
            leaf = xc.detach().requires_grad_(acc.x is not None)
            with torch.enable_grad():
                out = ctx.fn(ctx.owner, leaf, yc, *([mc] if mc is not None else [])).reshape(())
            slot = acc.x.narrow(0, start, n) if acc.x is not None else None
            acc.run(out, weight.reshape(()).to(out.dtype), leaf, slot)
            start += n
        x_grad = acc.x.reshape(x.shape) if acc.x is not None else None
        return (None, None, x_grad, None, None, None, None, None, *acc.params)


def sequence_tiled_compute(
    fn: Callable[..., torch.Tensor],
    seqlen: int,
    shards: int,
    kwargs_to_shard: dict[str, torch.Tensor],
    kwargs_to_pass: dict[str, Any],
    grad_requiring_tensor_key: str,
    compute_params: Iterable[torch.Tensor] | None = None,
    output_unshard_dimension: int = 1,
    output_reduction: str | None = "mean",
) -> torch.Tensor:
    """``fn(**kwargs_to_shard, **kwargs_to_pass)`` computed on ``shards`` chunks of the
    sequence dimension (dim 1) of every ``kwargs_to_shard`` tensor (``[B, seqlen, ...]``),
    recomputed chunk by chunk in backward (DeepSpeed's signature).

    Args:
        fn: called with keyword arguments; returns a tensor ``[B, chunk, ...]`` (joined along
            ``output_unshard_dimension``) or, with ``output_unshard_dimension=0``, a scalar
            per chunk (stacked).
        seqlen: the length of dim 1 of the sharded tensors; chunks are ``ceil(seqlen /
            shards)`` long, the last one shorter.
        grad_requiring_tensor_key: the sharded tensor that receives a gradient (the others
            are treated as constants, like labels).
        compute_params: the trainable tensors ``fn`` reads (their gradients are returned
            once per backward; ``fn`` reading any other trainable tensor is an error).
        output_reduction: None (the joined output), "mean" or "sum" of it.

    Raises:
        ValueError: an unknown reduction; ``grad_requiring_tensor_key`` not among
            ``kwargs_to_shard``.
    """
    if output_reduction not in (None, "mean", "sum"):
        raise ValueError(f"unknown value {output_reduction}: valid values are: none/mean/sum")
    if grad_requiring_tensor_key not in kwargs_to_shard:
        raise ValueError(
            f"grad_requiring_tensor_key={grad_requiring_tensor_key!r} must be one of "
            f"kwargs_to_shard's keys {sorted(kwargs_to_shard)}"
        )
    params = _params_of(compute_params, None)
    return SequenceTiledCompute.apply(  # type: ignore[no-any-return]
        fn,
        seqlen,
        shards,
        list(kwargs_to_shard),
        list(kwargs_to_pass),
        grad_requiring_tensor_key,
        params,
        output_unshard_dimension,
        output_reduction,
        *kwargs_to_shard.values(),
        *kwargs_to_pass.values(),
    )


class SequenceTiledCompute(torch.autograd.Function):
    """The autograd function behind :func:`sequence_tiled_compute` (call that instead: an
    autograd function cannot take dicts). ``compute_params`` is a list here: their gradients
    are returned through an extra trailing input per parameter, appended by ``apply``."""

    @classmethod
    def apply(cls, *args: Any) -> Any:  # type: ignore[override]
        params = [p for p in (args[6] or []) if p.requires_grad]
        return super().apply(*args[:6], len(params), *args[7:], *params)

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        fn: Callable[..., torch.Tensor],
        seqlen: int,
        shards: int,
        keys_to_shard: list[str],
        keys_to_pass: list[str],
        grad_requiring_tensor_key: str,
        n_params: int,
        output_unshard_dimension: int,
        output_reduction: str | None,
        *args: Any,
    ) -> torch.Tensor:
        n_sharded, n_passed = len(keys_to_shard), len(keys_to_pass)
        sharded = dict(zip(keys_to_shard, args[:n_sharded]))
        passed = dict(zip(keys_to_pass, args[n_sharded : n_sharded + n_passed]))
        params = list(args[n_sharded + n_passed :])
        ctx.fn, ctx.keys, ctx.passed, ctx.key = fn, keys_to_shard, passed, grad_requiring_tensor_key
        ctx.step = math.ceil(seqlen / shards)
        ctx.dim, ctx.reduction = output_unshard_dimension, output_reduction
        ctx.n_args = n_sharded + n_passed
        ctx.key_index = keys_to_shard.index(grad_requiring_tensor_key)
        ctx.params = list(params)  # see TiledMLP.forward
        ctx.save_for_backward(*sharded.values())
        with torch.no_grad():
            outs = [fn(**chunk, **passed) for chunk in _seq_chunks(sharded, ctx.step)]
        if output_unshard_dimension == 0:
            joined = torch.stack([o.reshape(()) for o in outs])
        else:
            joined = torch.cat(outs, dim=output_unshard_dimension)
        if output_reduction == "mean":
            ctx.count = joined.numel()
            return joined.mean()
        if output_reduction == "sum":
            return joined.sum()
        return joined

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        saved = list(ctx.saved_tensors)
        n = len(ctx.keys)
        sharded = dict(zip(ctx.keys, [t.detach() for t in saved[:n]]))
        params = ctx.params
        target = sharded[ctx.key]
        need_x = ctx.needs_input_grad[9 + ctx.key_index]
        acc = _ChunkGrads(target, params, need_x)
        offset = 0
        for chunk in _seq_chunks(sharded, ctx.step):
            length = chunk[ctx.key].shape[1]
            leaf = chunk[ctx.key].detach().requires_grad_(need_x)
            chunk[ctx.key] = leaf
            with torch.enable_grad():
                out = ctx.fn(**chunk, **ctx.passed)
            g = _chunk_grad(ctx, grad, out, offset, length)
            slot = acc.x.narrow(1, offset, length) if acc.x is not None else None
            acc.run(out, g, leaf, slot)
            offset += length
        inputs: list[torch.Tensor | None] = [None] * ctx.n_args
        inputs[ctx.key_index] = acc.x
        return (None,) * 9 + tuple(inputs) + tuple(acc.params)


def _seq_chunks(sharded: dict[str, torch.Tensor], step: int) -> list[dict[str, torch.Tensor]]:
    seqlen = next(iter(sharded.values())).shape[1]
    return [{k: v[:, lo : lo + step] for k, v in sharded.items()} for lo in range(0, seqlen, step)]


def _chunk_grad(
    ctx: Any, grad: torch.Tensor, out: torch.Tensor, offset: int, length: int
) -> torch.Tensor:
    """The upstream gradient of one chunk's output."""
    if ctx.reduction == "mean":
        return (grad / ctx.count).expand_as(out).to(out.dtype)
    if ctx.reduction == "sum":
        return grad.expand_as(out).to(out.dtype)
    if ctx.dim == 0:
        return grad[offset // ctx.step].reshape(out.shape)
    return grad.narrow(ctx.dim, offset, length)
