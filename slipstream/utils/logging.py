"""``deepspeed.utils.logging``: the library logger and ``log_dist``."""

from __future__ import annotations

import logging

from slipstream._logging import logger
from slipstream.distributed import comm

__all__ = ["log_dist", "logger"]


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """Log ``message`` prefixed with ``[Rank r]`` on the ranks DeepSpeed's ``log_dist`` picks.

    Before ``torch.distributed`` is initialized every process logs (as rank -1). After it,
    only the ranks in ``ranks`` log; ``ranks=[-1]`` means all ranks, and None or ``[]`` none.
    """
    initialized = comm.is_initialized()
    rank = comm.get_rank() if initialized else -1
    chosen = ranks or []
    if initialized and not (chosen and (chosen[0] == -1 or rank in set(chosen))):
        return
    logger.log(level, "[Rank %d] %s", rank, message)
