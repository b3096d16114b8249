"""Per-parameter shards of a model built under ``zero.Init``, before ``initialize``.

Each parameter is cut into ``world`` equal slices (the last padded with zeros) and rank ``r``
keeps slice ``r`` as ``p.ds_tensor`` (DeepSpeed's layout for ``zero.Init``); ``p`` itself is an
empty tensor with the ``ds_*`` attributes of :mod:`slipstream.zero.param`. The layout is over
the default (world) process group, or a world of one when ``torch.distributed`` is not
initialized (each shard is then the whole parameter and nothing is communicated).

``initialize`` at stage 3 re-lays these shards into its flat per-unit buckets one parameter at a
time (:meth:`InitShards.full`), so no rank ever holds more than one full parameter.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from slipstream.distributed import comm
from slipstream.zero.param import (
    INIT_OWNER_ATTR,
    ZeroParamStatus,
    bind_,
    empty_like_released,
    mark_partitioned_,
    release_,
)

__all__ = ["InitShards", "init_owner"]


def init_owner(p: torch.Tensor) -> InitShards | None:
    """The :class:`InitShards` holding ``p``'s shard, if ``zero.Init`` partitioned it."""
    return getattr(p, INIT_OWNER_ATTR, None)


class InitShards:
    """The shards of the parameters partitioned by one ``zero.Init`` (one per partitioning)."""

    def __init__(self) -> None:
        self.group: comm.Group = None  # the default group: zero.Init spans every rank
        self.world = comm.get_world_size()
        self.rank = comm.get_rank()
        self._depth: dict[int, int] = {}  # ds_id -> open GatheredParameters blocks
        self._guards: dict[int, RemovableHandle] = {}  # id(module) -> forward guard

    def chunk(self, numel: int) -> int:
        return -(-numel // self.world)

    # ------------------------------------------------------------------ partitioning
    @torch.no_grad()
    def keep_shard_(self, p: nn.Parameter, full: torch.Tensor) -> None:
        """``materialize_`` sink: keep this rank's slice of ``full`` (``p``'s initialized
        value) as ``p.ds_tensor`` and release ``p``."""
        flat = full.reshape(-1)
        if self.world == 1:
            shard = flat
        else:
            c = self.chunk(flat.numel())
            piece = flat[self.rank * c : (self.rank + 1) * c]
            shard = flat.new_zeros(c)
            shard[: piece.numel()].copy_(piece)
        setattr(p, INIT_OWNER_ATTR, self)
        mark_partitioned_(p, full.shape, shard)
        release_(p, empty_like_released(full))

    def guard_forward(self, module: nn.Module) -> None:
        """Refuse (with directions) a forward of ``module`` while its parameters are
        partitioned: before ``initialize`` nothing gathers them."""
        if id(module) not in self._guards:
            self._guards[id(module)] = module.register_forward_pre_hook(_refuse_partitioned)

    def drop_guards(self, model: nn.Module) -> None:
        for m in model.modules():
            handle = self._guards.pop(id(m), None)
            if handle is not None:
                handle.remove()

    # ---------------------------------------------------------------- gathered access
    def full(self, p: nn.Parameter) -> torch.Tensor:
        """``p``'s full value, 1-D (collective over the world: every rank calls it for the
        same parameter). A world of one returns the shard itself, not a copy."""
        shard: torch.Tensor = p.ds_tensor  # type: ignore[attr-defined]
        numel: int = p.ds_numel  # type: ignore[attr-defined]
        if self.world == 1:
            return shard[:numel]
        out = shard.new_empty(shard.numel() * self.world)
        comm.all_gather_into_tensor(out, shard, group=self.group, label="init_gather")
        return out[:numel]

    def gather(self, params: Sequence[nn.Parameter]) -> None:
        """Give ``params`` their full values (nested blocks gather once). Edits reach the
        shards only through ``modifier_rank`` (a world of one gets a copy too, as any other)."""
        for p in params:
            depth = self._depth.get(p.ds_id, 0)  # type: ignore[attr-defined]
            if depth == 0:
                value = self.full(p)
                if self.world == 1:
                    value = value.clone()
                bind_(p, value.view(p.ds_shape))  # type: ignore[attr-defined]
            self._depth[p.ds_id] = depth + 1  # type: ignore[attr-defined]

    def release(self, params: Sequence[nn.Parameter], modifier_rank: int | None) -> None:
        """End a ``GatheredParameters`` block: with ``modifier_rank``, that rank's values
        (edited in place or assigned with ``p.data = ...``) become every rank's shards."""
        if modifier_rank is not None and not 0 <= modifier_rank < self.world:
            raise ValueError(
                f"GatheredParameters(modifier_rank={modifier_rank}): the rank must be in "
                f"[0, {self.world}) (the world zero.Init partitioned over)"
            )
        for p in params:
            if modifier_rank is not None:
                self._keep_edits(p, modifier_rank)
            depth = self._depth.pop(p.ds_id) - 1  # type: ignore[attr-defined]
            if depth:
                self._depth[p.ds_id] = depth  # type: ignore[attr-defined]
            else:
                release_(p, empty_like_released(p))

    @torch.no_grad()
    def _keep_edits(self, p: nn.Parameter, modifier_rank: int) -> None:
        shard: torch.Tensor = p.ds_tensor  # type: ignore[attr-defined]
        value = p.data
        if value.shape != p.ds_shape:  # type: ignore[attr-defined]
            raise ValueError(
                f"GatheredParameters(modifier_rank={modifier_rank}): a parameter of shape "
                f"{tuple(p.ds_shape)} was given a value of shape {tuple(value.shape)} "  # type: ignore[attr-defined]
                "inside the block: assign (or copy_) a tensor of the parameter's shape"
            )
        flat = value.reshape(-1)
        if flat.dtype != shard.dtype or not flat.is_contiguous():
            flat = flat.to(shard.dtype).contiguous()
        if self.world == 1:
            if flat.data_ptr() != shard.data_ptr():
                shard[: flat.numel()].copy_(flat)
            return
        comm.broadcast(flat, src=modifier_rank, group=self.group, label="gathered_params")
        c = shard.numel()
        piece = flat[self.rank * c : (self.rank + 1) * c]
        shard[: piece.numel()].copy_(piece)


def _refuse_partitioned(module: nn.Module, args: object) -> None:
    for name, p in module._parameters.items():
        if p is None or init_owner(p) is None:
            continue
        if p.ds_status is not ZeroParamStatus.AVAILABLE:  # type: ignore[attr-defined]
            raise RuntimeError(
                f"forward of {type(module).__name__} while its parameter '{name}' (ds_shape "
                f"{tuple(p.ds_shape)}) is partitioned by zero.Init: this rank holds only its "  # type: ignore[attr-defined]
                "shard. Run the model after slipstream.initialize (which gathers each unit "
                "just in time), or inside `with slipstream.zero.GatheredParameters("
                "list(model.parameters())):`"
            )
