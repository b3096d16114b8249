"""``deepspeed.utils.comms_logging``: DeepSpeed's ``CommsLogger`` record store and its
bandwidth formulas.

A ``CommsLogger`` keeps ``comms_dict = {op name: {message bytes: [count, [latency ms],
[algbw Gbps], [busbw Gbps]]}}``; ``append`` adds one timed call (bandwidths from
:func:`calc_bw_log`, DeepSpeed's formulas), ``get_operation_summary`` / ``log_all`` give
count, total and trimmed-mean latency and bandwidths per message size, without reordering
what was recorded. slipstream's comm layer counts its own collectives in
``slipstream.distributed.counters`` (printed by ``deepspeed.comm.log_summary()`` and the
``comms_logger`` config block); this class is for code that records calls itself, as
DeepSpeed's comm wrappers do.
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Any

from slipstream._logging import log_rank0
from slipstream.distributed import comm
from slipstream.utils.timer import trim_mean

__all__ = ["CommsLogger", "calc_bw_log", "convert_size"]

_SIZE_NAMES = ("B", "KB", "MB", "GB", "TB", "PB", "EB", "ZB", "YB")
_GATHER_LIKE = {"all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor"}
_REDUCE_LIKE = {"all_reduce", "all_reduce_coalesced", "inference_all_reduce"}
_POINT = {"send", "recv", "isend", "irecv", "broadcast", "reduce", "gather", "scatter", "barrier"}


def convert_size(size_bytes: int) -> str:
    """``1536`` is ``"1.5 KB"`` (powers of 1024, two decimals)."""
    if size_bytes == 0:
        return "0B"
    i = math.floor(math.log(size_bytes, 1024))
    return f"{round(size_bytes / 1024**i, 2)} {_SIZE_NAMES[i]}"


def calc_bw_log(comm_op: str, size: float, duration: float) -> tuple[float, float]:
    """Algorithmic and bus bandwidth in Gbps of one call of ``comm_op`` moving ``size`` bytes
    (this rank's message) in ``duration`` (the unit of ``size / duration``, as DeepSpeed's).

    Raises:
        ValueError: an operation the formulas do not cover.
    """
    n = comm.get_world_size() if comm.is_initialized() else 1
    if comm_op == "all_to_all_single":
        tput = size / duration
        busbw = tput * (n - 1) / n
    elif comm_op in _GATHER_LIKE:
        tput = size * n / duration
        busbw = tput * (n - 1) / n
    elif comm_op in _REDUCE_LIKE:
        tput = size * 2 / duration
        busbw = size / duration * 2 * (n - 1) / n
    elif comm_op in _POINT:
        tput = busbw = size / duration
    else:
        raise ValueError(f"calc_bw_log: no bandwidth formula for comm op {comm_op!r}")
    return tput * 8 / 1e6, busbw * 8 / 1e6


class CommsLogger:
    """Timed communication calls by op and message size (see the module docstring)."""

    def __init__(self) -> None:
        self.comms_dict: dict[str, dict[int, list[Any]]] = {}
        self.verbose = False
        self.debug = False
        self.prof_ops: list[str] = []
        self.prof_all = True
        self.enabled = False

    def configure(self, comms_config: Any) -> None:
        """Take ``enabled``/``verbose``/``debug``/``prof_ops``/``prof_all`` from a config
        object with ``comms_logger_enabled`` and a ``comms_logger`` block."""
        self.enabled = bool(comms_config.comms_logger_enabled)
        if self.enabled:
            block = comms_config.comms_logger
            self.verbose, self.debug = block.verbose, getattr(block, "debug", False)
            self.prof_ops, self.prof_all = list(block.prof_ops), block.prof_all

    def start_profiling_comms(self) -> None:
        self.prof_all = True

    def stop_profiling_comms(self) -> None:
        self.prof_all = False

    def start_profiling_op(self, op_name_list: list[str]) -> None:
        self.prof_ops = list(set(self.prof_ops) | set(op_name_list))

    def stop_profiling_op(self, op_name_list: list[str]) -> None:
        self.prof_ops = [op for op in self.prof_ops if op not in op_name_list]

    def append(self, raw_name: str, record_name: str, latency: float, msg_size: int) -> None:
        """Record one call of ``raw_name`` (logged as ``record_name``) of ``msg_size`` bytes
        that took ``latency`` ms."""
        algbw, busbw = calc_bw_log(raw_name, msg_size, latency)
        entry = self.comms_dict.setdefault(record_name, {}).get(msg_size)
        if entry is None:
            self.comms_dict[record_name][msg_size] = [1, [latency], [algbw], [busbw]]
        else:
            entry[0] += 1
            entry[1].append(latency)
            entry[2].append(algbw)
            entry[3].append(busbw)
        if self.verbose:
            log_rank0(
                "comm op: %s | time (ms): %.2f | msg size: %s | algbw (Gbps): %.2f | "
                "busbw (Gbps): %.2f",
                record_name,
                latency,
                convert_size(msg_size),
                algbw,
                busbw,
            )

    def get_raw_data(self) -> dict[str, dict[int, list[Any]]]:
        return self.comms_dict.copy()

    def has_data(self) -> bool:
        return len(self.comms_dict) > 0

    def reset_data(self) -> None:
        self.comms_dict.clear()

    def get_operation_names(self) -> list[str]:
        return list(self.comms_dict)

    def get_total_operations(self) -> int:
        return sum(v[0] for sizes in self.comms_dict.values() for v in sizes.values())

    def get_operation_summary(self, operation_name: str) -> dict[int, dict[str, Any]] | None:
        """Per message size: count, total and 10%-trimmed mean latency and bandwidths; None
        for an op never recorded."""
        sizes = self.comms_dict.get(operation_name)
        if sizes is None:
            return None
        return {size: _summary(size, vals) for size, vals in sizes.items()}

    def log_all(
        self, print_log: bool = True, show_straggler: bool = False, return_dict: bool = False
    ) -> dict[str, Any] | None:
        """Log (rank 0) the summary table of every op; with ``return_dict``, return it.

        Raises:
            NotImplementedError: ``show_straggler`` (the cross-rank straggler analysis).
        """
        if show_straggler:
            raise NotImplementedError(
                "CommsLogger.log_all(show_straggler=True) is not built in slipstream: call it "
                "without show_straggler"
            )
        summary = {
            name: {size: _summary(size, vals) for size, vals in sorted(sizes.items())}
            for name, sizes in self.comms_dict.items()
        }
        if print_log:
            lines = [
                f"{'Comm. Op':<20}{'Message Size':<20}{'Count':<20}{'Total Latency(ms)':<20}"
                f"{'Avg Latency(ms)':<20}{'tput_avg (Gbps)':<20}{'busbw_avg (Gbps)':<20}"
            ]
            for name, sizes in summary.items():
                lines.append(name)
                for s in sizes.values():
                    lines.append(
                        f"{' ':<20}{s['msg_size_str']:<20}{s['count']:<20}"
                        f"{s['total_latency_ms']:<20.2f}{s['avg_latency_ms']:<20.2f}"
                        f"{s['tput_avg_gbps']:<20.2f}{s['busbw_avg_gbps']:<20.2f}"
                    )
            log_rank0("%s", "\n".join(lines))
        if not return_dict:
            return None
        return {
            "summary": summary,
            "straggler_analysis": None,
            "metadata": {
                "world_size": comm.get_world_size() if comm.is_initialized() else 1,
                "rank": comm.get_rank() if comm.is_initialized() else 0,
                "timestamp": datetime.now().isoformat(),
            },
        }


def _summary(size: int, vals: list[Any]) -> dict[str, Any]:
    return {
        "count": vals[0],
        "total_latency_ms": sum(vals[1]),
        "avg_latency_ms": trim_mean(vals[1], 0.1),
        "tput_avg_gbps": trim_mean(vals[2], 0.1),
        "busbw_avg_gbps": trim_mean(vals[3], 0.1),
        "msg_size_bytes": size,
        "msg_size_str": convert_size(size),
    }
