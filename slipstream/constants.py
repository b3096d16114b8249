"""``deepspeed.constants``: the launcher's environment names, default port and collective
timeout, as DeepSpeed names them.

``CROSS_RANK``/``CROSS_SIZE``/``LOCAL_RANK`` are the variables ``slipstream run`` sets for
every rank (the node's index, the number of nodes, the rank on the node).
``default_pg_timeout`` is the timeout slipstream's collectives use, read at import as
DeepSpeed reads it: ``SLIPSTREAM_COMM_TIMEOUT`` seconds, else DeepSpeed's ``DEEPSPEED_TIMEOUT``
minutes, else 10 minutes.
"""

from __future__ import annotations

from slipstream.cli.launcher import DEFAULT_MASTER_PORT
from slipstream.distributed.timeouts import comm_timeout

__all__ = [
    "CROSS_RANK",
    "CROSS_SIZE",
    "LOCAL_RANK",
    "TORCH_DISTRIBUTED_DEFAULT_PORT",
    "default_pg_timeout",
]

TORCH_DISTRIBUTED_DEFAULT_PORT = DEFAULT_MASTER_PORT
"""The rendezvous port when none is given (29500)."""
default_pg_timeout = comm_timeout()
CROSS_RANK = "CROSS_RANK"
CROSS_SIZE = "CROSS_SIZE"
LOCAL_RANK = "LOCAL_RANK"
