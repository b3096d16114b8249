"""``aio``: DeepSpeed's tuning of its asynchronous NVMe I/O library (libaio).

DeepSpeed reads this block for ZeRO-Infinity's NVMe offload: the size of each I/O request
(``block_size``), how many are in flight (``queue_depth``), how many threads split one
request (``intra_op_parallelism``), whether requests are submitted one by one
(``single_submit``) and whether completions overlap submission (``overlap_events``), and
GPUDirect Storage (``use_gds``). It changes how fast swap files are read and written, never
what is computed.

slipstream's NVMe offload (``offload_optimizer.device = "nvme"``, :mod:`slipstream.zero.swap`)
reads and writes each swap file synchronously, in one call, from the training thread, with a
checksum. None of these knobs has anything to act on there, so the block is accepted with
DeepSpeed's default values (what Lightning's ``DeepSpeedStrategy`` writes), and a value other
than the default is refused with the reason: slipstream would not do what it asks.
Lightning also writes ``thread_count``, the older name of ``intra_op_parallelism``.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from slipstream.config._base import StrictModel
from slipstream.config._errors import ConfigError

__all__ = ["AioConfig"]

_WHY = {
    "block_size": "slipstream writes and reads each swap file in one call, not in blocks",
    "queue_depth": "slipstream keeps one request in flight (synchronous file I/O)",
    "intra_op_parallelism": "slipstream does each swap read/write on one thread",
    "thread_count": "slipstream does each swap read/write on one thread",
    "single_submit": "slipstream submits no batched requests to choose from",
    "overlap_events": "slipstream's swap I/O is synchronous: nothing to overlap",
    "use_gds": "GPUDirect Storage is not implemented; swap files go through host memory",
}


class AioConfig(StrictModel):
    """``aio``: accepted at DeepSpeed's defaults (see the module docstring)."""

    block_size: int = Field(default=1048576, ge=1)
    """Bytes per I/O request (DeepSpeed's default 1 MiB)."""
    queue_depth: int = Field(default=8, ge=1)
    """I/O requests in flight (default 8)."""
    intra_op_parallelism: int = Field(default=1, ge=1)
    """Threads per request (default 1)."""
    thread_count: int = Field(default=1, ge=1)
    """Lightning's name for ``intra_op_parallelism`` (default 1)."""
    single_submit: bool = False
    """Submit requests one at a time (default false)."""
    overlap_events: bool = True
    """Overlap submission and completion (default true)."""
    use_gds: bool = False
    """GPUDirect Storage (default false)."""

    @model_validator(mode="after")
    def _only_defaults(self) -> AioConfig:
        for name, field in type(self).model_fields.items():
            value: Any = getattr(self, name)
            if value != field.default:
                raise ConfigError(
                    f"config key 'aio.{name}' = {value!r} cannot act in slipstream: "
                    f"{_WHY[name]}. Remove it or set DeepSpeed's default {field.default!r} "
                    "(the aio block tunes DeepSpeed's NVMe I/O library; slipstream's NVMe "
                    "offload needs no tuning)"
                )
        return self
