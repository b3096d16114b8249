"""``slipstream.comm``: the DeepSpeed-style collectives facade (``deepspeed.comm``)."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from slipstream._logging import logger
from slipstream.config import SlipstreamConfig
from slipstream.config._base import validate_model
from slipstream.config.loader import load_config
from slipstream.config.schema import CommsLoggerConfig
from slipstream.distributed import comm as _comm
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
    is_initialized,
    log_summary,
    reduce_scatter_tensor,
)

__all__ = [
    "ReduceOp",
    "TorchBackend",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all_single",
    "allgather_fn",
    "barrier",
    "broadcast",
    "comm_counters",
    "destroy_process_group",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "has_all_gather_into_tensor",
    "has_reduce_scatter_tensor",
    "init_distributed",
    "irecv",
    "is_initialized",
    "isend",
    "log_summary",
    "recv",
    "reduce_scatter_fn",
    "reduce_scatter_tensor",
    "send",
]

_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
# Set by mpirun/mpiexec (Open MPI, MPICH/Intel MPI/PMI) in each process it starts.
_MPI_ENV = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = 29500,
    verbose: bool = True,
    timeout: timedelta | None = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Initialize ``torch.distributed`` as DeepSpeed's ``init_distributed`` does.

    Args:
        dist_backend: nccl, gloo, ...; None takes the accelerator's (nccl on CUDA, gloo on CPU).
        auto_mpi_discovery: DeepSpeed reads the rank layout of a process started by
            ``mpirun`` through mpi4py. slipstream does not: such a process gets an error telling
            it to launch with ``slipstream run`` or torchrun (or to set the variables).
        distributed_port: the port DeepSpeed's MPI discovery would use; unused otherwise, as
            in DeepSpeed.
        verbose: log the initialization at INFO (else DEBUG).
        timeout: per-collective timeout; None takes ``SLIPSTREAM_COMM_TIMEOUT`` or its default.
        init_method: torch's rendezvous URL (``env://`` when None and the launcher set the
            variables).
        dist_init_required: False requires torch.distributed to be up already (error if not);
            True or None initialize it when it is not.
        config: a config (dict, path, ``SlipstreamConfig``) whose ``comms_logger`` block
            configures the communication counters, as DeepSpeed's ``configure`` does.
        rank, world_size: explicit rank and size for ``tcp://`` or ``file://`` init methods.

    Raises:
        RuntimeError: ``dist_init_required=False`` before initialization, or an MPI-launched
            process without the launcher variables.
    """
    if config is not None:
        _configure_comms_logger(config)
    if dist_init_required is False:
        if not _comm.is_initialized():
            raise RuntimeError(
                "init_distributed(dist_init_required=False) but torch.distributed is not "
                "initialized: pass dist_init_required=True (or None), or initialize it first"
            )
        return
    if _comm.is_initialized():
        logger.debug("init_distributed: torch.distributed is already initialized")
        return
    missing = [v for v in _LAUNCHER_ENV if v not in os.environ]
    if auto_mpi_discovery and missing and rank < 0 and any(v in os.environ for v in _MPI_ENV):
        raise RuntimeError(
            f"this process was started by MPI but {', '.join(missing)} are not set: slipstream "
            "does not discover ranks through mpi4py (DeepSpeed's auto_mpi_discovery). Launch "
            "with `slipstream run` or torchrun, or export RANK, WORLD_SIZE, LOCAL_RANK, "
            f"MASTER_ADDR and MASTER_PORT (e.g. port {distributed_port})"
        )
    _comm.init_distributed(
        dist_backend, timeout=timeout, init_method=init_method, rank=rank, world_size=world_size
    )
    level = "info" if verbose else "debug"
    if _comm.get_rank() == 0:
        getattr(logger, level)(
            "initialized torch.distributed: world %d, backend %s",
            _comm.get_world_size(),
            dist_backend or "default",
        )


def _configure_comms_logger(config: Any) -> None:
    """Apply a config's ``comms_logger`` block to the communication counters."""
    if isinstance(config, SlipstreamConfig):
        block = config.comms_logger
    else:
        raw = load_config(config).get("comms_logger", {})
        block = validate_model(CommsLoggerConfig, raw, "comms_logger")
    _comm.comm_counters.verbose = block.verbose
    if not block.prof_all:
        _comm.comm_counters.prof_ops = set(block.prof_ops)


class TorchBackend:
    """``deepspeed.comm.TorchBackend``: DeepSpeed's thin wrapper of ``torch.distributed``.

    Here it hands out slipstream's comm layer, so what a script runs through it is labelled
    and counted like every other collective. Constructing one initializes the default process
    group (as DeepSpeed's does) unless it already exists.
    """

    def __init__(
        self,
        backend: str | None,
        timeout: timedelta | None,
        init_method: str | None,
        rank: int = -1,
        world_size: int = -1,
        name: str = "torch",
    ) -> None:
        init_distributed(
            dist_backend=backend,
            timeout=timeout,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
        )
        self.name = name
        self.initialized = True

    @classmethod
    def get_all_gather_function(cls) -> Any:
        """The into-tensor all-gather, called ``f(output, input, group=None, async_op=False)``."""
        return all_gather_into_tensor

    @classmethod
    def get_reduce_scatter_function(cls) -> Any:
        """The tensor reduce-scatter, called ``f(output, input, op=..., group=None, ...)``."""
        return reduce_scatter_tensor

    def has_all_gather_into_tensor(self) -> bool:
        return True

    def has_reduce_scatter_tensor(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return is_initialized()

    def get_rank(self, group: Any = None) -> int:
        return get_rank(group)

    def get_world_size(self, group: Any = None) -> int:
        return get_world_size(group)


def allgather_fn(
    output_tensor: Any,
    input_tensor: Any,
    group: Any = None,
    async_op: bool = False,
    debug: Any = None,
) -> Any:
    """DeepSpeed's ``allgather_fn``: the into-tensor all-gather (``debug`` is ignored, as a
    label for DeepSpeed's comms logger)."""
    return all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter_fn(
    output_tensor: Any,
    tensor: Any,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
    prof: bool = False,
    debug: Any = None,
) -> Any:
    """DeepSpeed's ``reduce_scatter_fn``: the tensor reduce-scatter."""
    return reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def has_all_gather_into_tensor() -> bool:
    """Always true: slipstream's torch has ``all_gather_into_tensor``."""
    return True


def has_reduce_scatter_tensor() -> bool:
    """Always true: slipstream's torch has ``reduce_scatter_tensor``."""
    return True


def _pt2pt_checks(op: str, peer: int | None, tag: int) -> int:
    if tag != 0:
        raise ValueError(
            f"deepspeed.comm.{op}(tag={tag}): message tags are not supported (NCCL ignores "
            "them; messages between two ranks match in posting order): drop tag="
        )
    if peer is None:
        raise ValueError(
            f"deepspeed.comm.{op}(src=None): receiving from any rank is not supported: pass "
            "the sender's global rank as src="
        )
    return peer


def send(
    tensor: Any,
    dst: int,
    group: Any = None,
    tag: int = 0,
    prof: bool = False,
    log_name: str = "send",
    debug: Any = None,
) -> None:
    """DeepSpeed's blocking ``send`` to global rank ``dst``, counted as ``send``."""
    _comm.send(tensor, _pt2pt_checks("send", dst, tag), group, label=log_name)


def recv(
    tensor: Any,
    src: int | None = None,
    group: Any = None,
    tag: int = 0,
    prof: bool = False,
    log_name: str = "recv",
    debug: Any = None,
) -> int:
    """DeepSpeed's blocking ``recv`` from global rank ``src``; returns ``src``."""
    peer = _pt2pt_checks("recv", src, tag)
    _comm.recv(tensor, peer, group, label=log_name)
    return peer


def isend(
    tensor: Any,
    dst: int,
    group: Any = None,
    tag: int = 0,
    prof: bool = False,
    log_name: str = "isend",
    debug: Any = None,
) -> Any:
    """DeepSpeed's ``isend``: returns the work to ``wait()`` on."""
    return _comm.isend(tensor, _pt2pt_checks("isend", dst, tag), group, label=log_name)


def irecv(
    tensor: Any,
    src: int | None = None,
    group: Any = None,
    tag: int = 0,
    prof: bool = False,
    log_name: str = "irecv",
    debug: Any = None,
) -> Any:
    """DeepSpeed's ``irecv``: returns the work to ``wait()`` on."""
    return _comm.irecv(tensor, _pt2pt_checks("irecv", src, tag), group, label=log_name)
