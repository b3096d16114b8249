"""The ZeRO optimizer (every stage): master weights, step, clipping, parameter gather.

Each bucket has a master tensor: this rank's shard of the bucket (stages 1-3) or the whole
bucket (stage 0), in the master dtype. When the master dtype equals the parameter dtype the
master *is* that slice of the flat parameter storage (no copy). The wrapped torch optimizer
updates the master tensors, so its states have the same size as the masters: 1/dp of the
model at stages 1-3 (ZeRO-1, Rajbhandari et al. 2020, section 5.1). Where the parameters live
(full flat buckets at stages 0-2, per-unit shards at stage 3) is the ``ParamStore``'s business.

The engines and the checkpoint code use this class only through its public methods
(``set_gradient_sync``, ``finish_backward``, ``disarm_backward``, ``step``, ``trains``, ``add_reduced_grad``,
``bucket_shard(s)`` with the records of :mod:`.holdings`, ``owned_range``, ``owned_grad``,
``reload_params``, ``release_gathered``, ``memory_bytes``), never its store, reducer or views.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from slipstream.accelerator import get_accelerator
from slipstream.config import ConfigError
from slipstream.distributed import comm
from slipstream.optim.kinds import optimizer_kind
from slipstream.zero.flat import Bucket, FlatSlice, ParamStore
from slipstream.zero.grad_norm import GradNorm
from slipstream.zero.holdings import BucketShard, StatePiece
from slipstream.zero.policies import OPTIMIZER_CHUNK, StepPolicy
from slipstream.zero.reducer import GradientReducer
from slipstream.zero.swap import StateSwap

__all__ = [
    "OPTIMIZER_CHUNK",
    "BucketShard",
    "StatePiece",
    "StepPolicy",
    "ZeroOptimizer",
    "owner_of",
]

# param -> (its ZeRO optimizer, bucket index, index in the bucket), for the DeepSpeed helpers
# that take only a parameter (slipstream.utils.safe_get_full_fp32_param and friends). Weak
# both ways: the table keeps neither parameters nor optimizers alive.
_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def owner_of(param: torch.Tensor) -> tuple[ZeroOptimizer, int, int] | None:
    """The ZeRO optimizer that updates ``param``, its bucket and index; None if none does."""
    entry = _OWNERS.get(param)
    if entry is None:
        return None
    opt = entry[0]()
    return None if opt is None else (opt, entry[1], entry[2])


class ZeroOptimizer:
    """Optimizer wrapper returned by ``initialize`` (DeepSpeed's wrapped optimizer).

    Args:
        buckets: flat parameter buckets (see ``zero.flat``).
        reducer: gradient buffers and reduction.
        make_optimizer: builds the inner torch optimizer from param-group dicts whose
            ``params`` are the master tensors.
        group_hparams: hyperparameters of each param group (without ``params``).
        dp_group: data-parallel group.
        store: where parameters live; which region of each bucket this rank updates.
        master_dtype: dtype of master weights.
        step: loss scaling, clipping, overflow and optimizer-granularity policy.
    Raises:
        ConfigError: a layer-wise optimizer (LAMB, Adafactor) whose parameters would be split
            across ranks, or an optimizer of unknown kind without
            ``zero_allow_untested_optimizer``.
    """

    def __init__(
        self,
        buckets: Sequence[Bucket],
        reducer: GradientReducer,
        make_optimizer: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
        group_hparams: Sequence[dict[str, Any]],
        dp_group: comm.Group,
        store: ParamStore,
        master_dtype: torch.dtype,
        step: StepPolicy,
    ) -> None:
        self.buckets = list(buckets)
        self.reducer = reducer
        self.group = dp_group
        self.store = store
        self.dp_rank = comm.get_rank(dp_group)
        self.dp_size = comm.get_world_size(dp_group)
        self.partition = store.partitioned
        self.loss_scaler = step.loss_scaler
        self.clip = step.clip
        self.check_overflow = step.check_overflow or step.loss_scaler.enabled
        self.offload_device = step.offload_device
        self.pin_memory = step.pin_memory
        # Offload: each bucket's host buffers for its gradient and its cast weights.
        self._host_grads: dict[int, torch.Tensor] = {}
        self._host_params: dict[int, torch.Tensor] = {}
        self._owned = [store.owned_range(b.index) for b in self.buckets]
        self._where = {id(p): (b.index, i) for b in self.buckets for i, p in enumerate(b.params)}
        self.masters = [self._make_master(b, master_dtype) for b in self.buckets]
        store.attach_masters(self.masters)
        # One view per parameter (its part in this rank's shard) so layer-wise optimizers see
        # whole parameters; elementwise ones get big views split into sub-groups below.
        # ``_extents[b][k]``: (parameter index, where view k lies in bucket b).
        self._extents = [self._segments(b) for b in self.buckets]
        self._views = [
            [m[e.at(self._owned[b][0])] for _, e in self._extents[b]]
            for b, m in enumerate(self.masters)
        ]
        groups: list[dict[str, Any]] = [dict(h, params=[]) for h in group_hparams]
        for b, views in zip(self.buckets, self._views):
            groups[b.group_index]["params"].extend(views)
        self.optimizer = make_optimizer(groups)
        me = weakref.ref(self)
        for b_idx, owned in enumerate(self.buckets):
            for i, p in enumerate(owned.params):
                _OWNERS[p] = (me, b_idx, i)
        self._check_optimizer(step.allow_untested_optimizer)
        if optimizer_kind(type(self.optimizer)) == "elementwise":
            self._split_views(max(1, min(step.sub_group_size, OPTIMIZER_CHUNK)))
        self.tp_group, self.pp_group = step.tp_group, step.pp_group
        self._norm = GradNorm(
            self.buckets, self._owned, dp_group, self.partition, step.tp_group, step.pp_group
        )
        self.global_grad_norm: float | None = None
        self.overflow = False
        self.skip_step = False
        """Set True to make the next :meth:`step` skip (DeepSpeed's attribute; RLHF's
        ``align_overflow`` sets it when the other model overflowed); reset by that step."""
        self.skipped_on_request = False
        """Whether the last :meth:`step` was skipped because of :attr:`skip_step`."""
        self.swapper: StateSwap | None = None
        if step.swap_dir is not None:
            self.swapper = StateSwap(step.swap_dir, comm.get_rank())
            for index in range(len(self.buckets)):
                self._swap_out(index)

    def _separate_master(self, b: int) -> bool:
        return self.masters[b].data_ptr() != self.store.owned(b).data_ptr()

    def _swap_in(self, b: int) -> None:
        """Load bucket ``b``'s master (if separate) and optimizer states from their files."""
        assert self.swapper is not None
        master = self.swapper.load(b, self.optimizer.state, self._views[b])
        if master is not None:
            self.masters[b] = master
            lo = self._owned[b][0]
            for view, (_, e) in zip(self._views[b], self._extents[b]):
                view.data = master[e.at(lo)]

    def _swap_out(self, b: int) -> None:
        """Write bucket ``b``'s states (and separate master) to files and free their memory."""
        assert self.swapper is not None
        separate = self._separate_master(b)
        master = self.masters[b] if separate else None
        self.swapper.save(b, self.optimizer.state, self._views[b], master)
        if separate:
            self.masters[b] = self.masters[b].new_empty(0)
            for view in self._views[b]:
                view.data = self.masters[b]

    def _segments(self, bucket: Bucket) -> list[tuple[int, FlatSlice]]:
        """Each parameter's part of this rank's master region (whole bucket at stage 0)."""
        lo, hi = self._owned[bucket.index]
        parts = [(i, bucket.param_slice(i, lo, hi)) for i in range(len(bucket.params))]
        return [(i, part) for i, part in parts if part]

    def _check_optimizer(self, allow_untested: bool) -> None:
        cls = type(self.optimizer)
        kind = optimizer_kind(cls)
        if kind == "unknown" and not allow_untested:
            raise ConfigError(
                f"optimizer {cls.__name__} is not known to be elementwise, and ZeRO hands it flat "
                "slices of parameters: if each element's update depends only on that element "
                "(like Adam), set zero_allow_untested_optimizer: true; otherwise use a known one"
            )
        if kind == "layerwise" and self.partition:
            split = [
                b.names[i] for b in self.buckets for i in range(len(b.params)) if b.is_split(i)
            ]
            if split:
                raise ConfigError(
                    f"optimizer {cls.__name__} computes per-parameter statistics, but ZeRO stage >= 1 "
                    f"splits parameters across ranks (e.g. '{split[0]}'). Use ZeRO stage 0 with "
                    f"{cls.__name__}, or an elementwise optimizer (AdamW, Lion) at stages 1-3"
                )

    def _split_views(self, chunk: int) -> None:
        """Split views larger than ``chunk`` (before the first step, when state is empty)."""
        for b, segments in enumerate(self._extents):
            pieces = [
                (i, FlatSlice(seg.offset, j, min(j + chunk, seg.stop)))
                for i, seg in segments
                for j in range(seg.start, seg.stop, chunk)
            ]
            if len(pieces) == len(segments):
                continue
            old = {id(v) for v in self._views[b]}
            lo = self._owned[b][0]
            self._extents[b] = pieces
            self._views[b] = [self.masters[b][e.at(lo)] for _, e in pieces]
            for g in self.optimizer.param_groups:
                if any(id(p) in old for p in g["params"]):
                    g["params"] = [p for p in g["params"] if id(p) not in old] + self._views[b]

    def _make_master(self, bucket: Bucket, dtype: torch.dtype) -> torch.Tensor:
        region = self.store.owned(bucket.index)
        if self.offload_device is not None:  # CPU offload: always a host copy
            master = region.detach().to(device=self.offload_device, dtype=dtype, copy=True)
            if self.pin_memory:
                master = get_accelerator().pin_memory(master)  # a no-op without an accelerator
            return master
        if region.dtype == dtype:
            return region  # the master is the parameter storage itself
        return region.detach().to(dtype).clone()

    # ------------------------------------------------------------------ torch-like API
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear accumulated gradients (the module's ``.grad`` are always None)."""
        self.reducer.zero()

    def state_dict(self) -> dict[str, Any]:
        if self.swapper is not None:
            raise RuntimeError(
                "optimizer.state_dict() with offload_optimizer.device = 'nvme' is not supported "
                "(the states live in swap files): use engine.save_checkpoint, which handles them"
            )
        return {
            "optimizer": self.optimizer.state_dict(),
            "loss_scaler": self.loss_scaler.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.loss_scaler.load_state_dict(state["loss_scaler"])

    @property
    def parameter_offload(self) -> Any:
        """ZeRO stage 3 only: DeepSpeed's hooks API (``zero.parameter_offload``), which TRL's
        ``unwrap_model_for_generation`` uses. Stages 0-2 have none (``AttributeError``), as
        in DeepSpeed."""
        from slipstream.zero.sharded_store import ShardedStore

        if not isinstance(self.store, ShardedStore):
            raise AttributeError("parameter_offload exists at ZeRO stage 3 only")
        if getattr(self, "_parameter_offload", None) is None:
            from slipstream.zero.parameter_offload import DeepSpeedZeRoOffload

            self._parameter_offload = DeepSpeedZeRoOffload(self.store)
        return self._parameter_offload

    def destroy(self) -> None:
        """Remove every hook this optimizer installed on the model."""
        self.reducer.remove_hooks()
        self.store.remove_hooks()

    def state_bytes(self) -> int:
        """Bytes of optimizer state tensors held by this rank."""
        return sum(
            v.numel() * v.element_size()
            for s in self.optimizer.state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor)
        )

    def master_bytes(self) -> int:
        """Bytes of master weights held by this rank that are not parameter storage."""
        return sum(
            m.numel() * m.element_size()
            for m, b in zip(self.masters, self.buckets)
            if m.data_ptr() != self.store.owned(b.index).data_ptr()
        )

    def memory_bytes(self) -> dict[str, int]:
        """Bytes of model state this rank holds between steps, by kind, to compare with
        ``zero.estimate_memory``: the parameter storage (the whole bucket at stages 0-2, the
        shard at stage 3), the gradient accumulators, separate master weights, the
        optimizer states and, with the optimizer offloaded from an accelerator, the host
        buffers its copies go through (made at the first step)."""
        return {
            "params": sum(
                self.store.held(b.index).numel() * self.store.held(b.index).element_size()
                for b in self.buckets
            ),
            "grads": self.reducer.grad_bytes(),
            "master": self.master_bytes(),
            "optimizer": self.state_bytes(),
            "host_staging": sum(
                t.numel() * t.element_size()
                for t in (*self._host_grads.values(), *self._host_params.values())
            ),
        }

    # ------------------------------------------------------- the engines' and checkpoint's
    def set_gradient_sync(self, sync: bool) -> None:
        """Take the next backward passes as this engine's, and whether they end an
        accumulation cycle: their gradients are reduced across data-parallel ranks (stages
        0/1 reduce only then; stages 2/3 reduce every micro-step and accumulate the reduced
        shards). Passes run while not taken leave their gradients in ``param.grad``."""
        self.reducer.arm(sync)

    def finish_backward(self) -> None:
        """Finish the backward pass that just ran: launch the reductions still pending and
        wait for all of them (at stage 3 this also releases the units gathered for it).
        Later passes are not taken until the next ``set_gradient_sync``."""
        self.reducer.armed = False
        self.reducer.wait()

    def disarm_backward(self) -> None:
        """Take no more backward passes until the next ``set_gradient_sync`` (the engine
        calls it after each step, and when its backward raised)."""
        self.reducer.armed = False

    def trains(self, p: torch.Tensor) -> bool:
        """Whether ``p`` is one of the parameters this optimizer updates."""
        return id(p) in self._where

    def add_reduced_grad(self, p: nn.Parameter, grad: torch.Tensor) -> None:
        """Add ``grad`` (``p``'s full gradient, already averaged over the data-parallel
        ranks) to the gradient the next ``step`` applies; this rank keeps its part of it.

        Call it after the backward passes of a cycle (``finish_backward``) and before
        ``step``. Raises ``KeyError`` for a parameter the optimizer does not train.
        """
        b, i = self._where[id(p)]
        lo, hi = self._owned[b]
        mine = self.buckets[b].param_slice(i, lo, hi)
        if mine:
            shard = self.owned_grad(b)
            shard[mine.at(lo)] += grad.reshape(-1)[mine.param].to(shard.dtype)

    @contextmanager
    def bucket_shard(self, b: int) -> Iterator[BucketShard]:
        """Bucket ``b`` as this rank holds it, its master and optimizer states in memory for
        the block (NVMe offload swaps them in and out). Writes to the record's tensors land
        in the parameters, masters and optimizer states; after writing parameter values of
        several ranks' regions (a checkpoint load) call :meth:`reload_params`."""
        if self.swapper is not None:
            self._swap_in(b)
        try:
            yield BucketShard(
                bucket=self.buckets[b],
                held=self.store.held_range(b),
                params=self.store.held(b),
                owned=self._owned[b],
                master=self.masters[b],
                separate_master=self._separate_master(b),
                pieces=[
                    StatePiece(view, i, e) for view, (i, e) in zip(self._views[b], self._extents[b])
                ],
                transient=self.swapper is not None,
            )
        finally:
            if self.swapper is not None:
                self._swap_out(b)

    def bucket_shards(self) -> Iterator[BucketShard]:
        """:meth:`bucket_shard` of every bucket in turn."""
        for b in range(len(self.buckets)):
            with self.bucket_shard(b) as shard:
                yield shard

    def owned_range(self, b: int) -> tuple[int, int]:
        """The ``[start, stop)`` elements of bucket ``b`` this rank updates."""
        return self._owned[b]

    def owned_grad(self, b: int) -> torch.Tensor:
        """This rank's reduced gradient of bucket ``b``'s owned region (what ``step`` applies;
        complete after ``finish_backward`` on an accumulation boundary)."""
        return self.reducer.grad_shard(b)

    def release_gathered(self) -> None:
        """ZeRO-3: release every gathered unit now (persistent ones stay); else a no-op."""
        self.store.release_all()

    def reload_params(self) -> None:
        """After writing parameter values through :meth:`bucket_shards` (a checkpoint load):
        refresh every copy made from them (ZeRO-3's persistent units, hpZ's secondary
        shards). Collective over the data-parallel group."""
        self.store.refresh()

    # ---------------------------------------------------------------------- the step
    @torch.no_grad()
    def gradients_overflow(self) -> bool:
        """Whether the gradients accumulated for the next :meth:`step` are not finite (what
        would make it skip), decided the same on every rank (the norm is reduced over the
        data-parallel group: a collective). For checks across two models before either
        steps (RLHF's ``align_overflow``); False when overflow checking is off."""
        if not self.check_overflow:
            return False
        self.reducer.wait()
        grads = [self.reducer.grad_shard(i) for i in range(len(self.buckets))]
        return not math.isfinite(self._norm(grads))

    @torch.no_grad()
    def step(self) -> bool:
        """Unscale, clip, update and re-gather; returns False when the step was skipped."""
        self.reducer.wait()
        self.reducer.check_no_stray()
        grads = [self.reducer.grad_shard(i) for i in range(len(self.buckets))]
        self.skipped_on_request = self.skip_step
        if self.skip_step:  # asked to skip: no update, and no loss-scale change (no overflow)
            self.skip_step = False
            self.reducer.zero()
            return False
        inv_scale = 1.0 / self.loss_scaler.scale
        norm = self._norm(grads) * inv_scale
        self.global_grad_norm = norm
        self.overflow = self.check_overflow and not math.isfinite(norm)
        self.loss_scaler.update(self.overflow)
        if self.overflow:
            self.reducer.zero()
            return False
        coef = inv_scale
        if self.clip > 0 and norm > self.clip:
            coef *= self.clip / (norm + 1e-6)
        if self.offload_device is not None:
            self._step_offloaded(grads, coef)
            self.reducer.zero()
            return True
        # Bucket by bucket: the all-gather of an updated bucket overlaps the update of the
        # next one (torch optimizers skip tensors whose .grad is None).
        works = []
        for b, grad in enumerate(grads):
            if coef != 1.0:
                grad.mul_(coef)
            if self.swapper is not None:
                self._swap_in(b)
            lo = self._owned[b][0]
            for view, (_, e) in zip(self._views[b], self._extents[b]):
                g = grad[e.at(lo)]
                same = g.dtype == view.dtype and g.device == view.device
                view.grad = g if same else g.to(device=view.device, dtype=view.dtype)
            self.optimizer.step()
            for view in self._views[b]:
                view.grad = None
            works.append(self._publish(b))
            if self.swapper is not None:
                self._swap_out(b)
        for w in works:
            if w is not None:
                w.wait()
        self.reducer.zero()
        return True

    def _publish(self, b: int) -> Any:
        """Copy bucket ``b``'s updated master into the parameters; start sharing it.

        From a page-locked host master the copy is queued (``non_blocking``) and the caller
        goes on: stream order puts it before the all-gather and before the next step's
        gradient copies, which the host waits for before it writes this master again."""
        region, master = self.store.owned(b), self.masters[b]
        if master.data_ptr() != region.data_ptr():
            source = master
            if master.device != region.device and master.dtype != region.dtype:
                # Cast on the host into a staging buffer, so half the bytes cross the bus
                # (bf16 weights from fp32 masters) and the copy can run asynchronously.
                source = self._host_staging(self._host_params, b, region)
                source.copy_(master)
            region.copy_(source, non_blocking=True)
        return self.store.publish(b)

    def _step_offloaded(self, grads: list[torch.Tensor], coef: float) -> None:
        """ZeRO-Offload's step: gradients to host, the update on the CPU, weights back.

        Every bucket's gradient copy is queued first, into page-locked buffers reused from
        step to step, so the copy engine streams them while the CPU updates the buckets that
        already arrived; each updated bucket's weights are queued back to the device while
        the CPU goes on with the next one (Ren et al. 2021, "ZeRO-Offload", section 4.2).
        """
        accel = get_accelerator()
        arrived: list[tuple[torch.Tensor, Any]] = []
        for b, grad in enumerate(grads):
            if coef != 1.0:
                grad.mul_(coef)
            if grad.device == self.masters[b].device:  # forced CPU offload: nothing to copy
                arrived.append((grad, None))
                continue
            host = self._host_staging(self._host_grads, b, grad)
            host.copy_(grad, non_blocking=True)
            event = accel.Event()
            event.record()
            arrived.append((host, event))
        works = []
        for b, (grad, event) in enumerate(arrived):
            if event is not None:
                event.synchronize()
            lo = self._owned[b][0]
            for view, (_, e) in zip(self._views[b], self._extents[b]):
                g = grad[e.at(lo)]
                view.grad = g if g.dtype == view.dtype else g.to(view.dtype)
            self.optimizer.step()
            for view in self._views[b]:
                view.grad = None
            works.append(self._publish(b))
        for w in works:
            if w is not None:
                w.wait()

    def _host_staging(
        self, buffers: dict[int, torch.Tensor], b: int, like: torch.Tensor
    ) -> torch.Tensor:
        """Bucket ``b``'s host buffer shaped like ``like`` in ``buffers`` (the gradients
        coming to the host, or the weights going back): made at the first step, then reused;
        page-locked with ``pin_memory``, so copies through it run asynchronously. Stream
        order keeps a reuse from overtaking the copy of the step before."""
        buf = buffers.get(b)
        if buf is None or buf.numel() != like.numel() or buf.dtype != like.dtype:
            buf = torch.empty(like.numel(), dtype=like.dtype, device=self.offload_device)
            if self.pin_memory:
                buf = get_accelerator().pin_memory(buf)
            buffers[b] = buf
        return buf
