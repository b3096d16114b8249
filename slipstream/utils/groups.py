"""DeepSpeed's ``deepspeed.utils.groups``, the sequence-parallel part: the getters Accelerate's
Ulysses path (``Accelerator.deepspeed_ulysses_dl_adapter``) reads after ``initialize(mpu=...)``.

They answer from the groups of
:mod:`slipstream.runtime.sequence_parallel.parallel_state_sp` (built by
``UlyssesSPAttentionHF.register_with_transformers``); before those exist they raise a
``RuntimeError`` saying so.
"""

from __future__ import annotations

from slipstream.distributed import comm
from slipstream.runtime.sequence_parallel import parallel_state_sp

__all__ = [
    "_get_sequence_parallel_group",
    "_get_sequence_parallel_rank",
    "_get_sequence_parallel_world_size",
]


def _get_sequence_parallel_group() -> comm.Group:
    return parallel_state_sp.get_sequence_parallel_group()


def _get_sequence_parallel_world_size() -> int:
    return parallel_state_sp.get_sequence_parallel_world_size()


def _get_sequence_parallel_rank() -> int:
    return parallel_state_sp.get_sequence_parallel_rank()
