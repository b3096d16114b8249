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
    "_get_expert_parallel_ranks",
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


def _get_expert_parallel_ranks(
    world_size: int,
    tensor_parallel_size_: int,
    expert_parallel_size_: int,
    pipeline_parallel_size_: int = 1,
    use_data_before_expert_parallel_: bool = False,
) -> tuple[list[list[int]], list[list[int]]]:
    """DeepSpeed's expert-parallel and expert-data-parallel rank lists (no groups made).

    Ranks are laid out tensor-parallel fastest, then data-parallel, then pipeline stage. Each
    data-parallel group (one per stage and tensor-parallel index) is cut into consecutive
    chunks of ``expert_parallel_size_`` (the expert-parallel groups); the ranks at the same
    position of those chunks form the expert-data-parallel groups. With
    ``use_data_before_expert_parallel_`` the data-parallel group lists its ranks strided
    (the D + E layout), so expert-parallel groups span the stage.

    Raises:
        ValueError: the world does not divide into the sizes.
    """
    tp, ep, pp = tensor_parallel_size_, expert_parallel_size_, pipeline_parallel_size_
    if world_size % (tp * pp):
        raise ValueError(f"world size {world_size} is not divisible by tp {tp} x pp {pp}")
    dp = world_size // (tp * pp)
    if dp % ep:
        raise ValueError(f"data-parallel size {dp} is not divisible by expert-parallel size {ep}")
    stage = world_size // pp
    dp_groups: list[list[int]] = []
    for start in range(0, world_size, stage):
        for i in range(tp):
            if use_data_before_expert_parallel_:
                stride = dp // ep
                ranks: list[int] = []
                for d in range(stride):
                    ranks += range(start + i + d * tp, start + stage, stride * tp)
                dp_groups.append(ranks)
            else:
                dp_groups.append(list(range(start + i, start + stage, tp)))
    ep_groups: list[list[int]] = []
    edp_groups: list[list[int]] = []
    for ranks in dp_groups:
        chunks = [ranks[k : k + ep] for k in range(0, dp, ep)]
        ep_groups += chunks
        edp_groups += [list(column) for column in zip(*chunks, strict=True)]
    return ep_groups, edp_groups
