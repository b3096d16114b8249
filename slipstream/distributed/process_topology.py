"""Cartesian rank layouts: DeepSpeed's ``ProcessTopology`` family and the pipeline grid.

A topology names the axes of an N-dimensional grid of ranks (``["pipe", "data", "model"]``)
and their sizes; ranks are numbered row-major, the last axis fastest, as in DeepSpeed and
Megatron. Megatron-DeepSpeed builds its parallel state on these classes
(``deepspeed.runtime.pipe.topology``). ``PipelineParallelGrid`` makes the process groups of
a topology's pipe/data/model axes through slipstream's comm layer.
"""

from __future__ import annotations

import itertools
from collections import namedtuple
from typing import Any

from slipstream.distributed import comm

__all__ = [
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "PipelineParallelGrid",
    "ProcessTopology",
    "prime_factors",
]


class ProcessTopology:
    """A row-major map between ranks and coordinates on named axes."""

    def __init__(self, axes: list[str], dims: list[int]) -> None:
        if len(axes) != len(dims):
            raise ValueError(f"ProcessTopology: {len(axes)} axes {axes} but {len(dims)} dims")
        if len(set(axes)) != len(axes):
            raise ValueError(f"ProcessTopology: repeated axis names in {axes}")
        self.axes = list(axes)
        self.dims = [int(d) for d in dims]
        coord_type: Any = namedtuple("ProcessCoord", self.axes)  # type: ignore[misc]
        self.ProcessCoord = coord_type
        grid = itertools.product(*(range(d) for d in self.dims))
        self.mapping: dict[Any, int] = {coord_type(*c): rank for rank, c in enumerate(grid)}
        self._coords = {rank: coord for coord, rank in self.mapping.items()}

    def get_rank(self, **coord_kwargs: int) -> int:
        """The rank at a full coordinate (every axis named)."""
        if set(coord_kwargs) != set(self.axes):
            raise ValueError(f"get_rank: give every axis of {self.axes}, got {coord_kwargs}")
        key = self.ProcessCoord(**coord_kwargs)
        if key not in self.mapping:
            raise ValueError(f"get_rank: {coord_kwargs} is outside dims {self.dims}")
        return self.mapping[key]

    def get_axis_names(self) -> list[str]:
        return list(self.axes)

    def get_rank_repr(
        self,
        rank: int,
        omit_axes: list[str] | tuple[str, ...] = ("data", "pipe"),
        inner_sep: str = "_",
        outer_sep: str = "-",
    ) -> str:
        """``axis_NN`` parts of the rank's coordinate, skipping ``omit_axes`` (file names)."""
        coord = self.get_coord(rank)
        return outer_sep.join(
            f"{axis}{inner_sep}{getattr(coord, axis):02d}"
            for axis in self.axes
            if axis not in omit_axes
        )

    def get_dim(self, axis: str) -> int:
        """The size of ``axis`` (0 when the topology has no such axis)."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_coord(self, rank: int) -> Any:
        """The ``ProcessCoord`` namedtuple of ``rank``."""
        if rank not in self._coords:
            raise ValueError(f"get_coord: rank {rank} is not in a world of {self.world_size()}")
        return self._coords[rank]

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """The rank lists that vary only along ``axis`` (one per point of the other axes)."""
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for point in itertools.product(*(range(self.get_dim(a)) for a in others)):
            fixed = dict(zip(others, point, strict=True))
            lists.append([self.get_rank(**fixed, **{axis: i}) for i in range(self.get_dim(axis))])
        return lists

    def filter_match(self, **filter_kwargs: int) -> list[int]:
        """The ranks whose coordinate matches every given axis value, in rank order."""
        return [
            rank
            for coord, rank in sorted(self.mapping.items(), key=lambda kv: kv[1])
            if all(getattr(coord, k) == v for k, v in filter_kwargs.items())
        ]

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """The ranks whose coordinate on ``axis`` is ``idx``."""
        if axis not in self.axes:
            return []
        return self.filter_match(**{axis: idx})

    def world_size(self) -> int:
        return len(self.mapping)

    def __str__(self) -> str:
        return str(self.mapping)


def prime_factors(n: int) -> list[int]:
    """The prime factors of ``n`` in ascending order, with repetition."""
    if n <= 0:
        raise ValueError(f"prime_factors: {n} is not a positive integer")
    factors, p = [], 2
    while n > 1:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    return factors


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline stages of data-parallel replicas: axes ``pipe``, ``data``."""

    def __init__(self, num_pp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Megatron's 3D layout: axes ``pipe``, ``data``, ``model`` (model fastest)."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])


class PipelineParallelGrid:
    """This rank's place in a topology and the process groups of its axes.

    Every rank must build it (the groups are made collectively). Without a topology, the
    world is one pipeline stage of pure data parallelism.
    """

    def __init__(self, topology: ProcessTopology | None = None, process_group: Any = None) -> None:
        self.global_rank = comm.get_rank()
        self.world_size = comm.get_world_size()
        if topology is None:
            topology = PipeDataParallelTopology(num_pp=1, num_dp=self.world_size)
        if topology.world_size() != self.world_size:
            raise ValueError(
                f"PipelineParallelGrid: the topology has {topology.world_size()} ranks but "
                f"the world has {self.world_size}"
            )
        self._topo = topology
        self.data_parallel_size = max(topology.get_dim("data"), 1)
        self.pipe_parallel_size = max(topology.get_dim("pipe"), 1)
        self.model_parallel_size = max(topology.get_dim("model"), 1)
        self.slice_parallel_size = self.model_parallel_size
        coord = topology.get_coord(self.global_rank)
        self.stage_id = getattr(coord, "pipe", 0)
        self.data_parallel_id = getattr(coord, "data", 0)
        self.ds_model_proc_group = None
        self.ds_model_rank = -1
        self.dp_group: list[int] = []
        self.dp_proc_group = self._group_of("data")
        self.pp_group: list[int] = []
        self.pp_proc_group = self._group_of("pipe")
        self.slice_group: list[int] = []
        self.slice_proc_group = self._group_of("model")
        self.dp_group = self._ranks_of("data")
        self.pp_group = self._ranks_of("pipe")
        self.slice_group = self._ranks_of("model")

    def _ranks_of(self, axis: str) -> list[int]:
        for ranks in self._topo.get_axis_comm_lists(axis):
            if self.global_rank in ranks:
                return ranks
        return [self.global_rank]

    def _group_of(self, axis: str) -> Any:
        mine = None
        lists = self._topo.get_axis_comm_lists(axis) or [[r] for r in range(self.world_size)]
        for ranks in lists:
            group = comm.new_group(ranks, axis=axis)
            if self.global_rank in ranks:
                mine = group
        return mine

    def get_stage_id(self) -> int:
        return self.stage_id

    def get_data_parallel_id(self) -> int:
        return self.data_parallel_id

    def stage_to_global(self, stage_id: int, **kwargs: int) -> int:
        """The global rank of ``stage_id`` at this rank's other coordinates (or ``kwargs``)."""
        coord = self._topo.get_coord(self.global_rank)._replace(pipe=stage_id, **kwargs)
        return self._topo.get_rank(**coord._asdict())

    def topology(self) -> ProcessTopology:
        return self._topo

    def get_global_rank(self) -> int:
        return self.global_rank

    def get_pipe_parallel_rank(self) -> int:
        return self.stage_id

    def get_pipe_parallel_world_size(self) -> int:
        return self.pipe_parallel_size

    def get_pipe_parallel_group(self) -> Any:
        return self.pp_proc_group

    def get_data_parallel_rank(self) -> int:
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        return self.data_parallel_size

    def get_data_parallel_group(self) -> Any:
        return self.dp_proc_group

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self.dp_group)

    def get_model_parallel_rank(self) -> int:
        return self.slice_group.index(self.global_rank)

    def get_model_parallel_world_size(self) -> int:
        return self.model_parallel_size

    def get_model_parallel_group(self) -> Any:
        return self.slice_proc_group

    def get_slice_parallel_rank(self) -> int:
        return self.get_model_parallel_rank()

    def get_slice_parallel_world_size(self) -> int:
        return self.slice_parallel_size

    def get_slice_parallel_group(self) -> Any:
        return self.slice_proc_group

    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
