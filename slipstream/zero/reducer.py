"""Gradient accumulation and bucketed, overlapped reduction for every ZeRO stage.

A post-accumulate-grad hook on every trainable parameter adds its gradient into a flat,
bucket-sized buffer in the accumulation dtype (fp32 by default, so bf16/fp16 gradients are
accumulated without rounding) and frees ``param.grad``. When every parameter of a bucket has
reported, the bucket's collective is launched asynchronously (``overlap_comm``) while
backward continues:

* stage 0/1: the whole-model buffer is all-reduced on the accumulation boundary only
  (micro-steps in between accumulate locally, like DDP's ``no_sync``);
* stages 2/3: every micro-step reduce-scatters each bucket into this rank's shard
  accumulator, so no rank keeps a full set of gradients (ZeRO-2, Rajbhandari et al. 2020,
  section 5.2); at stage 3 a :class:`GradientListener` (the parameter store) hears when a
  bucket's gradients are all in, to free its unit.

Buckets are launched strictly in index order on every rank, so ranks issue identical
collective sequences even when parameters are unused or gradients arrive in another order.

Only the backward passes the engine runs are taken (``arm``: ``engine.backward``,
``engine.scale(loss).backward()``, the pipeline schedule). Several of them before one step
add up, at every stage, as plain PyTorch gradients do. A pass that reaches these parameters
while the engine is not armed (another engine's loss, as the generator's loss reaches the
discriminator in a GAN, or a plain ``loss.backward()``) leaves its gradients in
``param.grad`` as PyTorch would: ``module.zero_grad()`` drops them, otherwise the engine's
next backward takes them in, and a step with such gradients still pending is refused.

No buffer is zero-filled per step: the first gradient written into a region is copied, later
ones added, and regions nobody wrote are zeroed just before they are used. Stage-2 staging
buffers come from a small pool (at most ``MAX_IN_FLIGHT`` buckets reduce at once), so
steady-state training allocates nothing large — on CPU, large fresh allocations are served by
mmap and cost a page fault per 4 KiB.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from slipstream.distributed import comm, quantized_comm
from slipstream.zero.flat import Bucket

__all__ = ["GradientListener", "GradientReducer", "ReducePolicy"]


class GradientListener(Protocol):
    """Told about the progress of a backward pass (ZeRO-3's store frees units with it)."""

    def on_bucket_ready(self, b: int) -> None:
        """Every parameter of bucket ``b`` received its gradient in this pass."""
        ...

    def on_pass_end(self) -> None:
        """The backward pass ended (its reductions are complete)."""
        ...


@dataclass(frozen=True)
class ReducePolicy:
    """How gradients are accumulated and reduced.

    Attributes:
        partition_grads: stages 2/3 (reduce-scatter into shards) instead of all-reduce.
        accum_dtype: dtype of the accumulation buffers.
        reduce_dtype: dtype on the wire.
        overlap: launch collectives asynchronously during backward.
        predivide_factor: divide by this before reduction (``prescale_gradients``), by
            dp / factor after it; 1.0 divides by dp after the reduction.
        ignore_unused: reduce zeros for parameters without a gradient instead of raising.
        two_hop: see below.
        grad_block: see below.
    """

    partition_grads: bool
    accum_dtype: torch.dtype
    reduce_dtype: torch.dtype
    overlap: bool = True
    predivide_factor: float = 1.0
    ignore_unused: bool = True
    two_hop: tuple[comm.Group, comm.Group] | None = None
    """ZeRO++ qgZ: (node group, cross-node group); the reduce-scatter becomes two int4
    all-to-alls. The data-parallel group must be the whole world, node-major."""
    grad_block: int = 512
    """qgZ quantization block (elements)."""
    average: bool = True
    """Divide the reduced gradients by the data-parallel size (false: keep the sum)."""


MAX_IN_FLIGHT = 2


@dataclass
class _Pending:
    bucket: Bucket
    work: object
    wire: torch.Tensor
    out: torch.Tensor
    fresh: bool


class GradientReducer:
    """Owns gradient buffers and hooks; ``wait()`` leaves reduced gradients in place.

    After ``wait()`` on an accumulation boundary, ``grad_shard(b)`` is this rank's averaged
    gradient for bucket ``b`` (stage 0: the whole bucket).
    """

    def __init__(
        self,
        buckets: Sequence[Bucket],
        dp_group: comm.Group,
        policy: ReducePolicy,
        shard_grads: bool,
        listener: GradientListener | None = None,
    ) -> None:
        self.buckets = list(buckets)
        self.group = dp_group
        self.dp_size = comm.get_world_size(dp_group)
        self.dp_rank = comm.get_rank(dp_group)
        self.policy = policy
        self.shard_grads = shard_grads  # optimizer sees a shard (stages 1-3), not the bucket
        # Stage 3 frees a unit's gathered parameters once its gradients are in: the listener
        # gets on_bucket_ready(b) and on_pass_end().
        self.listener = listener
        self.sync = True  # ZeroOptimizer.set_gradient_sync: is this backward a boundary?
        # True while the engine's own backward may run (see the module docstring).
        self.armed = False
        self._stray: dict[nn.Parameter, str] = {}  # gradients a foreign pass left in .grad
        self._device = self.buckets[0].flat.device if self.buckets else torch.device("cpu")
        size = (lambda b: b.shard_numel) if policy.partition_grads else (lambda b: b.numel)
        self._accum = [self._empty(size(b)) for b in self.buckets]
        for buf in self._accum:
            buf.zero_()
        # Stage 0/1: parameter indices written into _accum since zero(). Stage 2: which
        # shard accumulators hold nothing yet this cycle (the next reduction overwrites).
        self._accum_written: list[set[int]] = [set() for _ in self.buckets]
        self._accum_fresh = [True] * len(self.buckets)
        self._staging: list[torch.Tensor | None] = [None] * len(self.buckets)
        self._staging_written: list[set[int]] = [set() for _ in self.buckets]
        self._pool: list[torch.Tensor] = []
        self._pool_numel = max((b.numel for b in self.buckets), default=0)
        self._where: dict[nn.Parameter, tuple[int, int]] = {}
        for b in self.buckets:
            for i, p in enumerate(b.params):
                self._where[p] = (b.index, i)
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._where]
        self._reset_pass()

    def arm(self, sync: bool) -> None:
        """Take the next backward passes (until ``armed`` is cleared); ``sync``: they end
        an accumulation window, so stage 0/1 all-reduce."""
        self.armed, self.sync = True, sync

    def _empty(self, numel: int) -> torch.Tensor:
        return torch.empty(numel, dtype=self.policy.accum_dtype, device=self._device)

    # ----------------------------------------------------------------- backward pass
    def _reset_pass(self) -> None:
        self._missing = [len(b.params) for b in self.buckets]
        self._seen: set[nn.Parameter] = set()
        self._next_launch = 0
        self._launched = [False] * len(self.buckets)
        self._pending: list[_Pending] = []
        self._callback_queued = False
        self._in_pass = False
        self._foreign_pass = False

    def _on_grad(self, param: torch.Tensor) -> None:
        assert isinstance(param, nn.Parameter) and param.grad is not None
        b_idx, i = self._where[param]
        bucket = self.buckets[b_idx]
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._callback_queued = True
        self._in_pass = True
        if not self.armed:  # not this engine's backward: leave the gradient in .grad
            self._foreign_pass = True
            self._stray[param] = bucket.names[i]
            self._note_seen(param, b_idx)
            return
        if self._launched[b_idx]:
            raise RuntimeError(
                f"parameter '{bucket.names[i]}' received a second gradient in one backward "
                "pass after its bucket was reduced (a reentrant autograd call inside the "
                "pass?): use non-reentrant activation checkpointing"
            )
        self._stray.pop(param, None)
        buf, written = self._target(b_idx)
        view = bucket.grad_view(buf, i)
        if i in written:
            view.add_(param.grad.reshape(-1))
        else:
            view.copy_(param.grad.reshape(-1))
            written.add(i)
        param.grad = None
        self._note_seen(param, b_idx)
        if self._communicating and self._missing[b_idx] == 0:
            self._launch_ready()

    def _note_seen(self, param: nn.Parameter, b_idx: int) -> None:
        if param not in self._seen:
            self._seen.add(param)
            self._missing[b_idx] -= 1
            if self._missing[b_idx] == 0 and self.listener is not None:
                self.listener.on_bucket_ready(b_idx)

    @property
    def _communicating(self) -> bool:
        return self.dp_size > 1 and (self.sync or self.policy.partition_grads)

    def _target(self, b_idx: int) -> tuple[torch.Tensor, set[int]]:
        """The buffer this pass writes bucket ``b_idx``'s gradients into."""
        if not self.policy.partition_grads:
            return self._accum[b_idx], self._accum_written[b_idx]
        staging = self._staging[b_idx]
        if staging is None:
            staging = self._take(self.buckets[b_idx].numel)
            self._staging[b_idx] = staging
            self._staging_written[b_idx] = set()
        return staging, self._staging_written[b_idx]

    def _take(self, numel: int) -> torch.Tensor:
        base = self._pool.pop() if self._pool else self._empty(self._pool_numel)
        return base[:numel]

    def _give(self, t: torch.Tensor) -> None:
        self._pool.append(t if t._base is None else t._base)

    def _fill_unwritten(self, bucket: Bucket, buf: torch.Tensor, written: set[int]) -> None:
        """Zero the regions of ``buf`` no gradient was written to (and the padding)."""
        for i in range(len(bucket.params)):
            if i not in written:
                bucket.grad_view(buf, i).zero_()
                written.add(i)
        end = bucket.offsets[-1] + bucket.numels[-1]
        if end < bucket.numel:
            buf[end:].zero_()

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets) and self._missing[self._next_launch] == 0:
            self._launch(self._next_launch)
            self._next_launch += 1

    def _launch(self, b_idx: int) -> None:
        bucket = self.buckets[b_idx]
        self._launched[b_idx] = True
        buf, written = self._target(b_idx)
        self._fill_unwritten(bucket, buf, written)
        wire = buf if buf.dtype == self.policy.reduce_dtype else buf.to(self.policy.reduce_dtype)
        if self.policy.predivide_factor != 1.0:
            wire.div_(self.policy.predivide_factor)
        while len(self._pending) >= MAX_IN_FLIGHT:
            self._complete(self._pending.pop(0))
        label = f"grad_bucket{b_idx}"
        fresh = self._accum_fresh[b_idx]
        if self.policy.partition_grads:
            same = wire.dtype == self.policy.accum_dtype
            out = self._accum[b_idx] if fresh and same else wire.new_empty(bucket.shard_numel)
            if self.policy.two_hop is not None and bucket.expert is None:
                node_group, cross_group = self.policy.two_hop
                quantized_comm.reduce_scatter_2hop_quantized(
                    out, wire, node_group, cross_group, 4, self.policy.grad_block, label=label
                )
                work = None
            else:
                work = comm.reduce_scatter_tensor(
                    out,
                    wire,
                    group=bucket.comm_group(self.group),
                    async_op=self.policy.overlap,
                    label=label,
                )
        else:
            out = wire
            work = comm.all_reduce(
                wire,
                group=bucket.comm_group(self.group),
                async_op=self.policy.overlap,
                label=label,
            )
        self._pending.append(_Pending(bucket, work, wire, out, fresh))
        if not self.policy.overlap:
            self._complete(self._pending.pop())

    def _complete(self, pending: _Pending) -> None:
        if pending.work is not None and hasattr(pending.work, "wait"):
            pending.work.wait()
        b_idx = pending.bucket.index
        # Expert buckets too: their sum over the expert-data-parallel group, divided by the
        # whole data-parallel size, is the global-batch mean (see slipstream.moe.plan).
        post = self.policy.predivide_factor / (self.dp_size if self.policy.average else 1)
        accum = self._accum[b_idx]
        if self.policy.partition_grads:
            if pending.out is accum:
                accum.mul_(post)
            elif pending.fresh:
                accum.copy_(pending.out).mul_(post)
            else:
                accum.add_(pending.out, alpha=post)
            self._accum_fresh[b_idx] = False
            staging = self._staging[b_idx]
            assert staging is not None
            self._give(staging)
            self._staging[b_idx] = None
        else:
            if pending.wire is not accum:
                accum.copy_(pending.wire)
            accum.mul_(post)

    def _end_of_backward(self) -> None:
        self.wait()

    def wait(self) -> None:
        """Finish the current backward pass: launch leftover buckets in order, wait for all."""
        if not self._in_pass:
            return
        if self._foreign_pass:
            self._reset_pass()
            if self.listener is not None:
                self.listener.on_pass_end()
            return
        # Gradients an earlier foreign pass left on parameters this pass did not reach
        # join this window, as they would in PyTorch.
        for param in [p for p in self._stray if p not in self._seen]:
            if param.grad is None:
                del self._stray[param]
            else:
                self._on_grad(param)
        if self._communicating:
            unused = [
                f"'{b.names[i]}'"
                for b in self.buckets
                for i, p in enumerate(b.params)
                if p not in self._seen
            ]
            if unused and not self.policy.ignore_unused:
                raise RuntimeError(
                    f"parameters received no gradient this step: {', '.join(unused[:8])}; set "
                    "zero_optimization.ignore_unused_parameters = true to reduce them as zeros"
                )
            for b_idx in range(self._next_launch, len(self.buckets)):
                self._launch(b_idx)
        for pending in self._pending:
            self._complete(pending)
        self._reset_pass()
        if self.listener is not None:
            self.listener.on_pass_end()

    # --------------------------------------------------------------------- optimizer
    def grad_shard(self, b_idx: int) -> torch.Tensor:
        """This rank's reduced gradient for bucket ``b_idx`` (what the optimizer updates)."""
        bucket = self.buckets[b_idx]
        if self.policy.partition_grads:
            if self._accum_fresh[b_idx]:  # no backward since zero(): the gradient is zero
                self._accum[b_idx].zero_()
                self._accum_fresh[b_idx] = False
            return self._accum[b_idx]
        self._fill_unwritten(bucket, self._accum[b_idx], self._accum_written[b_idx])
        if not self.shard_grads:
            return self._accum[b_idx]
        return self._accum[b_idx][bucket.shard_slice(comm.get_rank(bucket.comm_group(self.group)))]

    def check_no_stray(self) -> None:
        """Refuse to step while gradients of a foreign pass wait in ``param.grad``.

        They reached these parameters after this engine's last backward (another engine's
        loss, or a plain ``loss.backward()``); DeepSpeed's stage 0 would step on them
        unreduced, its stages 1-3 fail, so the user must decide.
        """
        self._stray = {p: n for p, n in self._stray.items() if p.grad is not None}
        stray = sorted(self._stray.values())
        if stray:
            raise RuntimeError(
                f"engine.step(): parameters {', '.join(repr(n) for n in stray[:8])} hold "
                "gradients from a backward pass this engine did not run (another engine's "
                "loss reached them, or loss.backward() was called instead of "
                "engine.backward(loss)) after this engine's last backward. Call "
                "module.zero_grad() to drop them, or run them through engine.backward()"
            )

    def zero(self) -> None:
        """Start a new accumulation cycle (no buffer memory is touched); gradients a
        foreign pass left in ``param.grad`` are dropped, as DeepSpeed's zero_grad does."""
        for param in self._stray:
            param.grad = None
        self._stray = {}
        for written in self._accum_written:
            written.clear()
        self._accum_fresh = [True] * len(self.buckets)

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def grad_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._accum)
