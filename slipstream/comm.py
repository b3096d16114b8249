"""``slipstream.comm``: the DeepSpeed-style collectives facade (``deepspeed.comm``)."""

from slipstream.distributed.comm import (
    ReduceOp,
    all_gather_into_tensor,
    all_gather_object,
    all_reduce,
    all_to_all_single,
    barrier,
    broadcast,
    comm_counters,
    destroy_process_group,
    get_local_rank,
    get_rank,
    get_world_size,
    init_distributed,
    is_initialized,
    log_summary,
    reduce_scatter_tensor,
)

__all__ = [
    "ReduceOp",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "comm_counters",
    "destroy_process_group",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_initialized",
    "log_summary",
    "reduce_scatter_tensor",
]
