"""The ZeRO optimizer for stages 0-2: master weights, step, clipping, parameter gather.

Each bucket has a master tensor: this rank's shard of the bucket (stages 1/2) or the whole
bucket (stage 0), in the master dtype. When the master dtype equals the parameter dtype the
master *is* that slice of the flat parameter storage (no copy). The wrapped torch optimizer
updates the master tensors, so its states have the same size as the masters: 1/dp of the
model at stages 1/2 (ZeRO-1, Rajbhandari et al. 2020, section 5.1).

The optimizer sees each master as views of at most ``min(sub_group_size, OPTIMIZER_CHUNK)``
elements (DeepSpeed's ``sub_group_size``): per-tensor temporaries of the optimizer math stay
small, which on CPU avoids a fresh mmap (and its page faults) for every temporary.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from slipstream.config import ConfigError
from slipstream.distributed import comm
from slipstream.distributed.placement import is_duplicate, tp_shard
from slipstream.optim.kinds import optimizer_kind
from slipstream.precision import LossScaler
from slipstream.zero.flat import Bucket, ParamStore
from slipstream.zero.reducer import GradientReducer
from slipstream.zero.swap import TensorSwapper

__all__ = ["OPTIMIZER_CHUNK", "StepPolicy", "ZeroOptimizer", "owner_of"]

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


OPTIMIZER_CHUNK = 1 << 22


@dataclass(frozen=True)
class StepPolicy:
    """What happens at the optimizer step besides the update itself.

    Attributes:
        loss_scaler: fp16 loss scale (``enabled=False`` for fp32/bf16).
        clip: global gradient-norm clip (0 disables).
        check_overflow: skip the step when the global gradient norm is inf/nan (every rank
            agrees: the norm is reduced over all of them). On by default in every precision.
        prescale_gradients: divide gradients by ``predivide_factor`` before reduction.
        predivide_factor: see ``prescale_gradients``.
        sub_group_size: largest tensor handed to an elementwise optimizer.
        allow_untested_optimizer: accept optimizer classes not known to be elementwise.
        swap_dir: keep optimizer states (and separate fp32 masters) in files here between
            steps (``offload_optimizer.device = "nvme"``).
        offload_device: keep master weights and optimizer states here (host memory, for
            ``offload_optimizer.device = "cpu"`` on a GPU) and run the optimizer step there;
            gradients are copied over per bucket and updated weights copied back.
        pin_memory: page-lock the offloaded masters (faster copies on CUDA).
        tp_group: tensor-parallel group: the global gradient norm sums the squares of
            tensor-parallel shards (parameters with a ``TPShard`` placement) over it, and
            counts replicated parameters once.
        pp_group: pipeline group: each stage holds different parameters, so the norm sums
            over it (parameters placed as duplicates, e.g. the second copy of a tied
            weight, are left out).
    """

    loss_scaler: LossScaler
    clip: float = 0.0
    check_overflow: bool = True
    prescale_gradients: bool = False
    predivide_factor: float = 1.0
    sub_group_size: int = OPTIMIZER_CHUNK
    allow_untested_optimizer: bool = False
    swap_dir: str | None = None
    offload_device: torch.device | None = None
    pin_memory: bool = False
    tp_group: comm.Group = None
    pp_group: comm.Group = None


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
        self.masters = [self._make_master(b, master_dtype) for b in self.buckets]
        if hasattr(store, "masters"):
            store.masters = self.masters  # stage 3: GatheredParameters edits reach the masters
        # One view per parameter (its part in this rank's shard) so layer-wise optimizers see
        # whole parameters; elementwise ones get big views split into sub-groups below.
        self._chunks = [self._segments(b) for b in self.buckets]
        self._views = [[m[c] for c in cs] for m, cs in zip(self.masters, self._chunks)]
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
        self._norm_parts = [self._norm_segments(b) for b in self.buckets]
        self.global_grad_norm: float | None = None
        self.overflow = False
        self.swapper: TensorSwapper | None = None
        self._small_state: dict[tuple[int, int, str], Any] = {}
        if step.swap_dir is not None:
            self.swapper = TensorSwapper(step.swap_dir, comm.get_rank())
            for index in range(len(self.buckets)):
                self._swap_out(index)

    def _separate_master(self, b: int) -> bool:
        return self.masters[b].data_ptr() != self.store.owned(b).data_ptr()

    def _swap_in(self, b: int) -> None:
        """Load bucket ``b``'s master (if separate) and optimizer states from their files."""
        assert self.swapper is not None
        if f"m{b}" in self.swapper:
            master = self.swapper.read(f"m{b}")["master"]
            self.masters[b] = master
            for view, c in zip(self._views[b], self._chunks[b]):
                view.data = master[c]
        if f"s{b}" in self.swapper:
            states = self.swapper.read(f"s{b}")
            for i, view in enumerate(self._views[b]):
                entry = {
                    k.split(".", 1)[1]: v for k, v in states.items() if k.split(".", 1)[0] == str(i)
                }
                entry.update(
                    {k: v for (bb, ii, k), v in self._small_state.items() if (bb, ii) == (b, i)}
                )
                self.optimizer.state[view] = entry

    def _swap_out(self, b: int) -> None:
        """Write bucket ``b``'s states (and separate master) to files and free their memory."""
        assert self.swapper is not None
        tensors = {}
        for i, view in enumerate(self._views[b]):
            for k, v in self.optimizer.state.pop(view, {}).items():
                if isinstance(v, torch.Tensor):
                    tensors[f"{i}.{k}"] = v
                else:
                    self._small_state[(b, i, k)] = v
        if tensors:
            self.swapper.write(f"s{b}", tensors)
        if self._separate_master(b):
            self.swapper.write(f"m{b}", {"master": self.masters[b]})
            self.masters[b] = self.masters[b].new_empty(0)
            for view in self._views[b]:
                view.data = self.masters[b]

    def _segments(self, bucket: Bucket) -> list[slice]:
        """Each parameter's slice of this rank's master region (whole bucket at stage 0)."""
        lo, hi = self.store.owned_range(bucket.index)
        out = []
        for off, n in zip(bucket.offsets, bucket.numels):
            start, stop = max(off, lo), min(off + n, hi)
            if start < stop:
                out.append(slice(start - lo, stop - lo))
        return out

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
                b.names[i]
                for b in self.buckets
                for i, (off, n) in enumerate(zip(b.offsets, b.numels))
                if any(off < s < off + n for s in range(b.shard_numel, b.numel, b.shard_numel))
            ]
            if split:
                raise ConfigError(
                    f"optimizer {cls.__name__} computes per-parameter statistics, but ZeRO stage >= 1 "
                    f"splits parameters across ranks (e.g. '{split[0]}'). Use ZeRO stage 0 with "
                    f"{cls.__name__}, or an elementwise optimizer (AdamW, Lion) at stages 1-2"
                )

    def _split_views(self, chunk: int) -> None:
        """Split views larger than ``chunk`` (before the first step, when state is empty)."""
        for b, segments in enumerate(self._chunks):
            pieces = [
                slice(i, min(i + chunk, seg.stop))
                for seg in segments
                for i in range(seg.start, seg.stop, chunk)
            ]
            if len(pieces) == len(segments):
                continue
            old = {id(v) for v in self._views[b]}
            self._chunks[b] = pieces
            self._views[b] = [self.masters[b][c] for c in pieces]
            for g in self.optimizer.param_groups:
                if any(id(p) in old for p in g["params"]):
                    g["params"] = [p for p in g["params"] if id(p) not in old] + self._views[b]

    def _make_master(self, bucket: Bucket, dtype: torch.dtype) -> torch.Tensor:
        region = self.store.owned(bucket.index)
        if self.offload_device is not None:  # CPU offload: always a host copy
            master = region.detach().to(device=self.offload_device, dtype=dtype, copy=True)
            if self.pin_memory and torch.cuda.is_available():
                master = master.pin_memory()
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

    def destroy(self) -> None:
        """Remove every hook this optimizer installed on the model."""
        self.reducer.remove_hooks()
        remove = getattr(self.store, "remove_hooks", None)
        if remove is not None:
            remove()

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

    # ---------------------------------------------------------------------- the step
    @torch.no_grad()
    def step(self) -> bool:
        """Unscale, clip, update and re-gather; returns False when the step was skipped."""
        self.reducer.wait()
        grads = [self.reducer.grad_shard(i) for i in range(len(self.buckets))]
        inv_scale = 1.0 / self.loss_scaler.scale
        norm = self._global_norm(grads) * inv_scale
        self.global_grad_norm = norm
        self.overflow = self.check_overflow and not math.isfinite(norm)
        self.loss_scaler.update(self.overflow)
        if self.overflow:
            self.reducer.zero()
            return False
        coef = inv_scale
        if self.clip > 0 and norm > self.clip:
            coef *= self.clip / (norm + 1e-6)
        # Bucket by bucket: the all-gather of an updated bucket overlaps the update of the
        # next one (torch optimizers skip tensors whose .grad is None).
        works = []
        for b, grad in enumerate(grads):
            if coef != 1.0:
                grad.mul_(coef)
            if self.swapper is not None:
                self._swap_in(b)
            for view, c in zip(self._views[b], self._chunks[b]):
                g = grad[c]
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

    def _norm_segments(self, bucket: Bucket) -> list[tuple[slice, int]] | None:
        """(slice of this rank's shard, kind) per parameter: 0 tensor-parallel shard,
        1 replicated, 2 left out of the norm; None when every parameter is replicated."""
        if self.tp_group is None and self.pp_group is None:
            return None
        lo, hi = self.store.owned_range(bucket.index)
        parts = []
        for off, p, n in zip(bucket.offsets, bucket.params, bucket.numels):
            start, stop = max(off, lo), min(off + n, hi)
            if start < stop:
                kind = 2 if is_duplicate(p) else 1
                if kind == 1 and tp_shard(p) is not None:
                    kind = 0
                parts.append((slice(start - lo, stop - lo), kind))
        return None if all(k == 1 for _, k in parts) else parts

    def _global_norm(self, grads: Sequence[torch.Tensor]) -> float:
        """L2 norm of the whole model's gradient: over data-, tensor- and pipeline-parallel
        ranks, each element counted once.

        Every rank gets a non-finite result when any rank holds an inf/nan gradient, which
        is what lets ``step`` skip (or raise) everywhere at once: the data-parallel squares
        are all-reduced at stages 1-3 (at stage 0 the gradients themselves were, and a sum
        keeps inf/nan), the tensor- and pipeline-parallel reductions carry them the rest of
        the way. Communication: at most one small all-reduce per group, none at stage 0
        without model parallelism.
        """
        device = grads[0].device if grads else torch.device("cpu")
        sq = torch.zeros(3, dtype=torch.float32, device=device)  # tp-sharded, replicated, skip
        for g, parts in zip(grads, self._norm_parts):
            if parts is None:
                sq[1] += torch.linalg.vector_norm(g, dtype=torch.float32).square()
                continue
            for sl, kind in parts:
                sq[kind] += torch.linalg.vector_norm(g[sl], dtype=torch.float32).square()
        if self.partition:
            comm.all_reduce(sq, group=self.group, label="grad_norm")
        if self.tp_group is not None:
            # Replicated parameters are counted once, so their squares stay local; send
            # ``sq[1] * 0`` along (0 when finite, nan otherwise) so that a non-finite value on
            # one tensor-parallel rank reaches all of them in the same message.
            both = torch.stack([sq[0], sq[1] * 0])
            comm.all_reduce(both, group=self.tp_group, label="grad_norm")
            sq[0] = both[0]
            sq[1] += both[1]
        total = sq[:2].sum()
        if self.pp_group is not None:
            comm.all_reduce(total, group=self.pp_group, label="grad_norm")
        return float(total.sqrt())

    def _publish(self, b: int) -> Any:
        """Copy bucket ``b``'s updated master into the parameters; start sharing it."""
        region, master = self.store.owned(b), self.masters[b]
        if master.data_ptr() != region.data_ptr():
            region.copy_(master)
        return self.store.publish(b)
