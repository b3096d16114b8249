"""``deepspeed.runtime.pipe.topology``: rank layouts and the pipeline grid (Megatron-DeepSpeed
builds its parallel state on these). The classes live in ``slipstream.distributed``."""

from slipstream.distributed.process_topology import (
    PipeDataParallelTopology,
    PipelineParallelGrid,
    PipeModelDataParallelTopology,
    ProcessTopology,
    prime_factors,
)

_prime_factors = prime_factors

__all__ = [
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "PipelineParallelGrid",
    "ProcessTopology",
]
