"""Flat, bucketed parameter storage: the layout every ZeRO stage shares.

Trainable parameters are laid out (in reverse registration order, which is roughly the
order backward produces their gradients) into buckets of about ``reduce_bucket_size``
elements (stages 0-2), or one bucket per ZeRO-3 unit, param group and dtype (stage 3). Each
bucket owns one flat tensor in the parameter dtype and every parameter becomes a view into it,
so a bucket can be reduced or gathered with one collective. Each bucket is padded to a
multiple of the data-parallel size and split into equal contiguous shards: rank ``r`` owns
elements ``[r * shard, (r + 1) * shard)`` of every bucket (ZeRO's flat partitioning,
Rajbhandari et al. 2020, section 5).

Shards ignore parameter boundaries, so a parameter may lie wholly, partly or not at all in a
rank's shard: :class:`FlatSlice` (``Bucket.param_slice``) is the one place that answers which
part. Where the parameters live between steps is a :class:`ParamStore`: :class:`FlatStore`
here for stages 0-2, ``ShardedStore`` for stage 3.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from slipstream.distributed import comm
from slipstream.distributed.expert import ExpertGroups
from slipstream.zero.init import set_data_
from slipstream.zero.param import full_shape, is_slipstream_partitioned

__all__ = [
    "Bucket",
    "FlatSlice",
    "FlatStore",
    "ParamStore",
    "Waitable",
    "build_buckets",
    "expert_of",
    "make_bucket",
]


@dataclass(frozen=True)
class FlatSlice:
    """Elements ``[start, stop)`` of a flat bucket, all of them in one parameter that begins
    at bucket element ``offset``.

    ``FlatSlice.whole(offset, numel).within(lo, hi)`` answers "which part of this parameter
    is in the region ``[lo, hi)`` (a rank's shard), and where is it in the parameter and in
    the region". An empty answer sits at the edge of the region nearest the parameter, so
    ``region[s.at(lo)]`` is still an in-bounds (empty) view.
    """

    offset: int
    start: int
    stop: int

    @classmethod
    def whole(cls, offset: int, numel: int) -> FlatSlice:
        """The parameter of ``numel`` elements laid out at bucket element ``offset``."""
        return cls(offset, offset, offset + numel)

    @property
    def numel(self) -> int:
        return self.stop - self.start

    def __bool__(self) -> bool:
        return self.stop > self.start

    def within(self, lo: int, hi: int) -> FlatSlice:
        """The part of this slice inside bucket elements ``[lo, hi)``."""
        start = min(max(self.start, lo), hi)
        return FlatSlice(self.offset, start, max(min(self.stop, hi), start))

    @property
    def param(self) -> slice:
        """These elements in the flattened parameter."""
        return slice(self.start - self.offset, self.stop - self.offset)

    def at(self, base: int) -> slice:
        """These elements in a 1-D tensor that holds the bucket from element ``base`` on
        (a rank's shard starts at ``lo``; the whole bucket at 0)."""
        return slice(self.start - base, self.stop - base)


@dataclass
class Bucket:
    """One reduction unit: parameters of one dtype and one optimizer param group."""

    index: int
    group_index: int
    params: list[nn.Parameter]
    names: list[str]
    offsets: list[int]
    numel: int
    dp_size: int
    flat: torch.Tensor = field(repr=False)
    # Each parameter's full shape and its view of ``flat``: kept here because a ZeRO-3
    # parameter outside its unit's forward/backward is an empty tensor (``param.numel()`` 0).
    shapes: list[torch.Size] = field(default_factory=list, repr=False)
    views: list[torch.Tensor] = field(default_factory=list, repr=False)
    expert: ExpertGroups | None = field(default=None, repr=False)
    """Expert buckets (MoE with ``ep_size`` > 1): their groups. The gradient is reduced and
    the bucket sharded over ``expert.edp_group`` (``dp_size`` is its size), not the whole
    data-parallel group; None for every other bucket."""

    def comm_group(self, dp_group: comm.Group) -> comm.Group:
        """The group this bucket is reduced and sharded over."""
        return self.expert.edp_group if self.expert is not None else dp_group

    @property
    def numels(self) -> list[int]:
        """Full number of elements of each parameter (whether or not it is gathered)."""
        return [v.numel() for v in self.views]

    @property
    def shard_numel(self) -> int:
        return self.numel // self.dp_size

    def shard_slice(self, dp_rank: int) -> slice:
        return slice(dp_rank * self.shard_numel, (dp_rank + 1) * self.shard_numel)

    def param_slice(self, i: int, lo: int = 0, hi: int | None = None) -> FlatSlice:
        """The part of parameter ``i`` inside bucket elements ``[lo, hi)`` (default: all)."""
        whole = FlatSlice.whole(self.offsets[i], self.shapes[i].numel())
        return whole.within(lo, self.numel if hi is None else hi)

    def is_split(self, i: int) -> bool:
        """Whether parameter ``i`` spans more than one rank's shard."""
        numel = self.shapes[i].numel()
        if numel == 0:
            return False
        s = self.shard_slice(self.offsets[i] // self.shard_numel)  # where its first element is
        return self.param_slice(i, s.start, s.stop).numel < numel

    def renew_storage(self) -> None:
        """Point ``flat`` and ``views`` at new, unallocated storage (0 bytes until the next
        gather), leaving the old storage to whoever still holds a tensor of it: a NumPy array,
        a ``state_dict()`` entry taken inside ``GatheredParameters`` keeps its values, and the
        memory goes when the last of them does (as DeepSpeed's released parameters)."""
        flat = torch.empty(self.numel, dtype=self.flat.dtype, device=self.flat.device)
        self.views = [flat[o : o + s.numel()].view(s) for o, s in zip(self.offsets, self.shapes)]
        flat.untyped_storage().resize_(0)
        self.flat = flat

    def grad_view(self, buffer: torch.Tensor, i: int) -> torch.Tensor:
        """The 1-D region of a bucket-sized ``buffer`` that belongs to parameter ``i``."""
        return buffer[self.offsets[i] : self.offsets[i] + self.views[i].numel()]


def _pad(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def build_buckets(
    groups: Sequence[Sequence[nn.Parameter]],
    names: dict[nn.Parameter, str],
    bucket_numel: int,
    dp_size: int,
    experts: dict[str, ExpertGroups] | None = None,
) -> list[Bucket]:
    """Lay out ``groups`` of trainable parameters into flat buckets; params become views.

    Args:
        groups: parameters per optimizer param group (each parameter in exactly one group).
        names: qualified name of each parameter, for error messages.
        bucket_numel: target elements per bucket (a larger parameter gets its own bucket).
        dp_size: data-parallel size; every bucket is padded to a multiple of it.
        experts: MoE expert groups by expert group name (``param.group_name``); expert
            parameters of an ``ep_size`` > 1 get buckets of their own, padded to a multiple
            of their expert-data-parallel size, after the dense buckets.
    Returns:
        Buckets in launch order (the order gradients are expected to become ready).
    """
    buckets: list[Bucket] = []
    expert_lists: dict[str, list[tuple[int, list[nn.Parameter]]]] = {}
    for gi, params in enumerate(groups):
        dense = []
        for p in params:
            g = expert_of(p, experts)
            if g is None:
                dense.append(p)
            else:
                runs = expert_lists.setdefault(p.group_name, [])  # type: ignore[attr-defined]
                if not runs or runs[-1][0] != gi:
                    runs.append((gi, []))
                runs[-1][1].append(p)
        _add_buckets(buckets, gi, dense, names, bucket_numel, dp_size, None)
    for name, runs in expert_lists.items():
        assert experts is not None
        g = experts[name]
        for gi, plist in runs:
            size = comm.get_world_size(g.edp_group)
            _add_buckets(buckets, gi, plist, names, bucket_numel, size, g)
    return buckets


def expert_of(p: nn.Parameter, experts: dict[str, ExpertGroups] | None) -> ExpertGroups | None:
    """The expert groups of an expert parameter with ``ep_size`` > 1, else None."""
    if getattr(p, "allreduce", True) is not False:
        return None
    name = getattr(p, "group_name", None)
    if experts is None or name not in experts:
        raise ValueError(
            f"expert parameter of MoE group {name!r} but no expert-parallel groups were given: "
            "apply slipstream.moe.expert_parallel_(model, mesh) and pass its result as "
            "shard_zero_(..., experts=...) (slipstream.initialize does both)"
        )
    g = experts[name]
    return g if g.ep_size > 1 else None


def _add_buckets(
    buckets: list[Bucket],
    gi: int,
    params: Sequence[nn.Parameter],
    names: dict[nn.Parameter, str],
    bucket_numel: int,
    dp_size: int,
    expert: ExpertGroups | None,
) -> None:
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for p in reversed(list(params)):
        by_dtype.setdefault(p.dtype, []).append(p)
    for plist in by_dtype.values():
        current: list[nn.Parameter] = []
        size = 0
        for p in plist:
            if current and size + p.numel() > bucket_numel:
                buckets.append(make_bucket(len(buckets), gi, current, names, dp_size))
                buckets[-1].expert = expert
                current, size = [], 0
            current.append(p)
            size += p.numel()
        if current:
            buckets.append(make_bucket(len(buckets), gi, current, names, dp_size))
            buckets[-1].expert = expert


def make_bucket(
    index: int,
    group_index: int,
    params: list[nn.Parameter],
    names: dict[nn.Parameter, str],
    dp: int,
    device: torch.device | None = None,
) -> Bucket:
    """Lay ``params`` out in one flat tensor; each becomes a view into it.

    Parameters partitioned by ``zero.Init`` (empty, the real shape in ``ds_shape``) get a flat
    tensor on ``device`` whose storage is released at once: ZeRO-3 fills their shards from
    the ``zero.Init`` shards and points them at their views when it gathers them.
    """
    shapes = [full_shape(p) for p in params]
    offsets, total = [], 0
    for shape in shapes:
        offsets.append(total)
        total += shape.numel()
    numel = _pad(total, dp)
    first = params[0]
    deferred = is_slipstream_partitioned(first)
    if any(is_slipstream_partitioned(p) != deferred for p in params):
        raise ValueError(
            f"bucket mixes zero.Init-partitioned and ordinary parameters "
            f"({[names[p] for p in params][:4]}...): build the whole model inside zero.Init, "
            "or none of it"
        )
    if deferred:  # views need in-bounds storage to be made; released right after
        flat = torch.empty(numel, dtype=first.dtype, device=device)
    else:
        flat = torch.zeros(numel, dtype=first.dtype, device=first.device)
    views = []
    for p, off, shape in zip(params, offsets, shapes):
        view = flat[off : off + shape.numel()].view(shape)
        views.append(view)
        if not deferred:
            view.copy_(p.detach())
            set_data_(p, view)
    if deferred:
        flat.untyped_storage().resize_(0)
    names_ = [names[p] for p in params]
    return Bucket(index, group_index, params, names_, offsets, numel, dp, flat, shapes, views)


class Waitable(Protocol):
    """An asynchronous collective in flight (``torch.distributed``'s ``Work``)."""

    def wait(self) -> Any: ...


class ParamStore(Protocol):
    """Where each bucket's parameters live between steps, and which region of each bucket
    this rank updates. :class:`FlatStore` (stages 0-2) and ``ShardedStore`` (stage 3) satisfy
    it; the optimizer (and, through it, the checkpoint code) uses nothing else of a store.

    Ranges are ``[start, stop)`` in bucket element coordinates.
    """

    partitioned: bool
    """This rank updates only its shard of each bucket (stages 1-3 with more than one rank)."""

    def held_range(self, b: int) -> tuple[int, int]:
        """What this rank stores of bucket ``b`` between steps (all of it at stages 0-2)."""
        ...

    def held(self, b: int) -> torch.Tensor:
        """The storage of :meth:`held_range` (parameter dtype)."""
        ...

    def owned_range(self, b: int) -> tuple[int, int]:
        """The region of bucket ``b`` this rank updates (inside :meth:`held_range`)."""
        ...

    def owned(self, b: int) -> torch.Tensor:
        """The storage of :meth:`owned_range` (parameter dtype)."""
        ...

    def publish(self, b: int) -> Waitable | None:
        """After an update of the owned region: share it with the ranks that need it (async
        work, or None when there is nothing to wait for)."""
        ...

    def refresh(self) -> None:
        """The held regions were overwritten outside a step (a checkpoint load): bring every
        copy made from them up to date. Collective over the data-parallel group."""
        ...

    def attach_masters(self, masters: list[torch.Tensor]) -> None:
        """The optimizer's master weights (one per bucket, this list kept current), for edits
        that must reach them (ZeRO-3 ``GatheredParameters(modifier_rank=...)``)."""
        ...

    def remove_hooks(self) -> None:
        """Remove every hook the store installed on the model."""
        ...

    def release_all(self) -> None:
        """Free every gathered copy of parameters that is not needed between steps."""
        ...


class FlatStore:
    """Where each bucket's parameters live for stages 0-2: full flat storage on every rank.

    With ``partitioned`` (stages 1/2) this rank owns (updates) slice ``shard_slice(dp_rank)``
    of every bucket and ``publish`` all-gathers the updated slices; otherwise it owns all.
    """

    def __init__(self, buckets: Sequence[Bucket], dp_group: comm.Group, partitioned: bool) -> None:
        self.buckets = list(buckets)
        self.group = dp_group
        self.dp_rank = comm.get_rank(dp_group)
        self.partitioned = partitioned and comm.get_world_size(dp_group) > 1

    def held_range(self, b: int) -> tuple[int, int]:
        return 0, self.buckets[b].numel

    def held(self, b: int) -> torch.Tensor:
        return self.buckets[b].flat

    def owned_range(self, b: int) -> tuple[int, int]:
        """[start, stop) of bucket ``b`` (in bucket element coordinates) this rank updates."""
        bucket = self.buckets[b]
        if not self.partitioned:
            return 0, bucket.numel
        s = bucket.shard_slice(comm.get_rank(bucket.comm_group(self.group)))
        return s.start, s.stop

    def owned(self, b: int) -> torch.Tensor:
        """The storage of this rank's owned region of bucket ``b`` (parameter dtype)."""
        lo, hi = self.owned_range(b)
        return self.buckets[b].flat[lo:hi]

    def publish(self, b: int) -> Waitable | None:
        """Make bucket ``b``'s updated owned region visible to every rank (async work or None)."""
        if not self.partitioned:
            return None
        bucket = self.buckets[b]
        # In place (NCCL and gloo support it): this rank's shard is already at its slot.
        return comm.all_gather_into_tensor(
            bucket.flat,
            self.owned(b),
            group=bucket.comm_group(self.group),
            async_op=True,
            label=f"param_bucket{b}",
        )

    def refresh(self) -> None:
        """Nothing to do: every rank holds (and a load fills) the whole of every bucket."""

    def attach_masters(self, masters: list[torch.Tensor]) -> None:
        """Nothing to do: parameters change only through the optimizer step."""

    def remove_hooks(self) -> None:
        """Nothing to do: the store installs no hooks (the reducer's are its own)."""

    def release_all(self) -> None:
        """Nothing to do: stages 0-2 keep every parameter whole."""
