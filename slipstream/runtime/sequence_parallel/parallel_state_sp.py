"""DeepSpeed's ``deepspeed.runtime.sequence_parallel.parallel_state_sp``: the sequence-parallel
groups an ALST script builds before ``initialize`` and passes to it as ``mpu=``.

The groups have the layout of slipstream's mesh (the ranks ``d*P .. d*P+P-1`` share sequence
``d``; the sequence-data-parallel group is every rank), so ``initialize(mpu=this module)``
accepts it when the config's ``sequence_parallel_size`` equals P.
"""

from __future__ import annotations

from slipstream.distributed import comm
from slipstream.distributed.groups import world_group
from slipstream.distributed.mesh import consecutive_group

__all__ = [
    "get_model_parallel_group",
    "get_model_parallel_rank",
    "get_model_parallel_world_size",
    "get_sequence_data_parallel_group",
    "get_sequence_data_parallel_rank",
    "get_sequence_data_parallel_world_size",
    "get_sequence_parallel_group",
    "get_sequence_parallel_rank",
    "get_sequence_parallel_world_size",
    "initialize_sequence_parallel",
]

_SEQUENCE_PARALLEL_GROUP: comm.Group = None
_SEQUENCE_DATA_PARALLEL_GROUP: comm.Group = None
_SIZE = 0


def initialize_sequence_parallel(sequence_parallel_size: int) -> None:
    """Build the groups (every rank calls it; torch.distributed must be initialized).

    Raises:
        ValueError: ``sequence_parallel_size`` < 2, larger than or not dividing the world,
            or groups already built with another size.
    """
    global _SEQUENCE_PARALLEL_GROUP, _SEQUENCE_DATA_PARALLEL_GROUP, _SIZE
    if _SIZE and sequence_parallel_size != _SIZE:
        raise ValueError(
            f"sequence-parallel groups already built with size {_SIZE}, asked for "
            f"{sequence_parallel_size}: build them once per process"
        )
    if _SIZE:
        return
    comm.init_distributed()
    world = comm.get_world_size()
    if sequence_parallel_size <= 1 or world % sequence_parallel_size:
        raise ValueError(
            f"sequence_parallel_size={sequence_parallel_size} must be at least 2 and divide "
            f"the world size {world}"
        )
    # The mesh's layout: ranks d*P .. d*P+P-1 share a sequence; the sequence-data-parallel
    # group is the whole world. Both are group objects, never None (the default group), as
    # DeepSpeed's are: ALST scripts and DeepSpeed's tests check `group is not None`.
    _SEQUENCE_PARALLEL_GROUP = consecutive_group(sequence_parallel_size, axis="sp") or world_group()
    _SEQUENCE_DATA_PARALLEL_GROUP = world_group()
    _SIZE = sequence_parallel_size


def _check() -> None:
    if not _SIZE:
        raise RuntimeError(
            "sequence parallel group is not initialized: call "
            "initialize_sequence_parallel(sequence_parallel_size) first (or "
            "UlyssesSPAttentionHF.register_with_transformers, which does)"
        )


def get_sequence_parallel_group() -> comm.Group:
    """The sequence-parallel group of this rank."""
    _check()
    return _SEQUENCE_PARALLEL_GROUP


def get_sequence_data_parallel_group() -> comm.Group:
    """The group of every rank (data x sequence parallel), over which ZeRO reduces."""
    _check()
    return _SEQUENCE_DATA_PARALLEL_GROUP


def get_sequence_parallel_world_size() -> int:
    return comm.get_world_size(get_sequence_parallel_group())


def get_sequence_data_parallel_world_size() -> int:
    return comm.get_world_size(get_sequence_data_parallel_group())


def get_sequence_parallel_rank() -> int:
    return comm.get_rank(get_sequence_parallel_group())


def get_sequence_data_parallel_rank() -> int:
    return comm.get_rank(get_sequence_data_parallel_group())


# DeepSpeed aliases model parallelism to sequence parallelism here (one extra dimension).
get_model_parallel_rank = get_sequence_parallel_rank
get_model_parallel_world_size = get_sequence_parallel_world_size
get_model_parallel_group = get_sequence_parallel_group
