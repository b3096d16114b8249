"""Library logger; messages from rank 0 only unless asked otherwise."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("slipstream")
if not logger.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("[slipstream %(levelname)s] %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(os.environ.get("SLIPSTREAM_LOG_LEVEL", "INFO").upper())
    logger.propagate = False


def global_rank() -> int:
    """Rank of this process in the default group (0 when not distributed)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def log_rank0(msg: str, *args: object, level: int = logging.INFO) -> None:
    """Log on global rank 0 only."""
    if global_rank() == 0:
        logger.log(level, msg, *args)
