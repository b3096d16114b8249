"""The one communication layer: every collective in slipstream goes through here.

Each call is labelled with the mesh axis of its process group and its message bytes are
counted per (axis, op), so ``log_summary()`` can say how much traffic each parallelism axis
generated. Works with gloo (CPU) and NCCL (CUDA) alike.

A collective that does not complete within the process-group timeout
(``SLIPSTREAM_COMM_TIMEOUT`` seconds, default 600) raises :class:`CollectiveTimeoutError`
naming the collective (op, label, axis, number on its group), this rank, and the ranks that
did not arrive (:mod:`slipstream.distributed.timeouts`).
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import re
import socket
import sys
import time
import weakref
from collections import defaultdict
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from slipstream._logging import logger
from slipstream.accelerator import get_accelerator
from slipstream.distributed._arrivals import arrivals
from slipstream.distributed._exit import (
    DEFAULT_EXIT_TIMEOUT_S,
    arm_exit_watchdog,
    exit_timeout_s,
    first_difference,
    settle_comm_threads,
    wait_at_exit,
)
from slipstream.distributed.counters import (
    comm_counters,
    log_summary,
    set_ranks_per_node,
    summary_table,
)
from slipstream.distributed.groups import (
    Group,
    axis_name,
    get_local_rank,
    is_process_group,
    register_axis,
)
from slipstream.distributed.timeouts import (
    COMM_TIMEOUT_ENV,
    DEFAULT_COMM_TIMEOUT_S,
    Call,
    CollectiveTimeoutError,
    comm_timeout,
    issue,
    note_timeout_in_use,
)

__all__ = [
    "COMM_TIMEOUT_ENV",
    "DEFAULT_COMM_TIMEOUT_S",
    "CollectiveTimeoutError",
    "PeerDiedError",
    "ReduceOp",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all_single",
    "all_true",
    "any_true",
    "axis_name",
    "barrier",
    "broadcast",
    "check_same_across_ranks",
    "comm_counters",
    "comm_timeout",
    "destroy_process_group",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "global_rank",
    "init_distributed",
    "irecv",
    "is_initialized",
    "is_process_group",
    "isend",
    "log_summary",
    "max_int",
    "new_group",
    "recv",
    "reduce_scatter_tensor",
    "register_axis",
    "send",
    "set_ranks_per_node",
    "summary_table",
    "wait_at_exit",
]

ReduceOp = dist.ReduceOp


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _collective(op: str, group: Group, label: str | None) -> Call:
    return Call(op, group, label, arrivals.enter(op, group, label))


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def init_distributed(
    dist_backend: str | None = None,
    *,
    timeout: timedelta | None = None,
    init_method: str | None = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Initialize ``torch.distributed`` once (DeepSpeed's ``init_distributed``).

    Reads RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT as set by ``slipstream run`` or torchrun;
    without them runs as a world of one. The backend defaults to NCCL when CUDA is present
    and gloo otherwise; on CUDA the current device becomes ``LOCAL_RANK``.
    """
    if is_initialized():
        return
    if rank < 0 and "RANK" not in os.environ:
        # A world of one. The rendezvous address goes in init_method, not the environment:
        # a MASTER_PORT left in os.environ would be inherited by every process this one
        # launches later (their own rendezvous would then collide with this live one).
        if init_method is None:
            addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
            port = os.environ.get("MASTER_PORT") or str(_free_port())
            init_method = f"tcp://{addr}:{port}"
        rank, world_size = 0, 1
        os.environ.setdefault("LOCAL_RANK", "0")
    acc = get_accelerator()
    backend = dist_backend or acc.communication_backend_name()
    if acc.device_name() != "cpu" and backend != "gloo":
        acc.set_device(get_local_rank())
    timeout = timeout or comm_timeout()
    exit_timeout_s()  # refuse a bad SLIPSTREAM_EXIT_TIMEOUT now, not at exit
    note_timeout_in_use(timeout)
    kwargs: dict[str, Any] = {"backend": backend, "timeout": timeout}
    if init_method is not None:
        kwargs["init_method"] = init_method
    if rank >= 0:
        kwargs.update(rank=rank, world_size=world_size)
    dist.init_process_group(**kwargs)
    atexit.register(_shutdown)
    logger.debug(
        "initialized torch.distributed: backend=%s world=%d", backend, dist.get_world_size()
    )


_EXIT_HOOKS: list[Any] = []  # weak references to callables that finish in-flight work


def at_exit(method: Any) -> None:
    """Run ``method(deadline)`` (a bound method, held weakly) before the process group is torn
    down at interpreter exit: e.g. wait for prefetch all-gathers still in flight. ``deadline``
    (``time.monotonic()``, or None for no limit) is when every such wait must give up."""
    _EXIT_HOOKS.append(weakref.WeakMethod(method))


def _shutdown() -> None:
    """At exit: finish in-flight work (each wait bounded by ``SLIPSTREAM_EXIT_TIMEOUT``),
    destroy the process group slipstream made, let gloo's threads settle, then arm a watchdog
    that ends the process if finalization is still stuck after that timeout.

    Tearing a gloo group down while asynchronous work is pending aborts the process
    ("terminate called without an active exception") when the script did not call
    ``engine.destroy()`` / ``destroy_process_group()`` itself.
    """
    try:
        limit = exit_timeout_s()
    except ValueError as err:  # init_distributed refused it; changed since
        logger.warning("%s", err)
        limit = DEFAULT_EXIT_TIMEOUT_S
    deadline = time.monotonic() + limit if limit > 0 else None
    who = f"rank {get_rank()}" if get_world_size() > 1 else "this process"
    for ref in _EXIT_HOOKS:
        hook = ref()
        if hook is not None:
            try:
                hook(deadline)
            except Exception as e:  # a peer already gone: nothing left to finish
                logger.debug("exit hook failed: %s", e)
    destroy_process_group()
    settle_comm_threads()
    for stream in (sys.stdout, sys.stderr):  # what finalization would flush, before any kill
        with contextlib.suppress(AttributeError, OSError, ValueError):
            stream.flush()
    arm_exit_watchdog(limit, who)


def destroy_process_group() -> None:
    """Tear down the default process group (no-op when there is none)."""
    if is_initialized():
        dist.destroy_process_group()


def get_rank(group: Group = None) -> int:
    return dist.get_rank(group) if is_initialized() else 0


def get_world_size(group: Group = None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def global_rank(group: Group, group_rank: int) -> int:
    """Global rank of ``group_rank`` within ``group``."""
    if group is None or not is_initialized():
        return group_rank
    return dist.get_global_rank(group, group_rank)


def all_reduce(
    tensor: torch.Tensor,
    op: dist.ReduceOp.RedOpType = ReduceOp.SUM,
    group: Group = None,
    async_op: bool = False,
    label: str | None = None,
) -> dist.Work | None:
    """In-place all-reduce of ``tensor``; message bytes = tensor bytes."""
    comm_counters.record("all_reduce", group, _nbytes(tensor), label)
    call = _collective("all_reduce", group, label)
    return issue(call, lambda: dist.all_reduce(tensor, op=op, group=group, async_op=async_op))


def _is_gloo(group: Group) -> bool:
    return dist.get_backend(group) == "gloo"


def _int_reduce(
    value: int,
    op: dist.ReduceOp.RedOpType,
    group: Group,
    label: str | None,
    dtype: torch.dtype,
) -> int:
    """``value`` reduced by ``op`` over ``group`` in one ``dtype`` element (``value`` itself
    without a world or in a group of one)."""
    if not is_initialized() or get_world_size(group) == 1:
        return value
    # The group's backend decides where the element lives (NCCL reduces only device tensors).
    device = "cpu" if _is_gloo(group) else get_accelerator().current_device_name()
    t = torch.tensor([value], dtype=dtype, device=device)
    all_reduce(t, op=op, group=group, label=label)
    return int(t.item())


def _flag_reduce(flag: bool, op: dist.ReduceOp.RedOpType, group: Group, label: str | None) -> bool:
    return bool(_int_reduce(1 if flag else 0, op, group, label, torch.int32))


def all_true(flag: bool, group: Group = None, label: str | None = None) -> bool:
    """Whether ``flag`` holds on every rank of ``group`` (one 4-byte all-reduce, MIN).

    Every rank of the group must call it. Without a world, or in a group of one: ``flag``.
    """
    return _flag_reduce(flag, ReduceOp.MIN, group, label)


def any_true(flag: bool, group: Group = None, label: str | None = None) -> bool:
    """Whether ``flag`` holds on some rank of ``group`` (one 4-byte all-reduce, MAX).

    Every rank of the group must call it. Without a world, or in a group of one: ``flag``.
    """
    return _flag_reduce(flag, ReduceOp.MAX, group, label)


def max_int(value: int, group: Group = None, label: str | None = None) -> int:
    """The largest of every rank's ``value`` in ``group`` (one 8-byte all-reduce, MAX), e.g.
    how many times ranks that must call a collective in lock-step each call it.

    Every rank of the group must call it. Without a world, or in a group of one: ``value``.
    """
    return _int_reduce(value, ReduceOp.MAX, group, label, torch.int64)


_ScratchKey = tuple[int, torch.dtype, torch.device]


class _ScratchPool:
    """Reusable 1-D scratch tensors (large fresh CPU allocations page-fault on every use)."""

    def __init__(self) -> None:
        self.free: dict[_ScratchKey, list[torch.Tensor]] = defaultdict(list)

    def take(self, like: torch.Tensor) -> torch.Tensor:
        key = (like.numel(), like.dtype, like.device)
        return self.free[key].pop() if self.free[key] else torch.empty_like(like).reshape(-1)

    def give(self, t: torch.Tensor) -> None:
        self.free[(t.numel(), t.dtype, t.device)].append(t)


_scratch = _ScratchPool()


class _Finish:
    """A Work whose ``wait()`` also runs a local completion step (and is idempotent)."""

    def __init__(self, work: dist.Work | None, finish: Any) -> None:
        self.work, self.finish, self.done = work, finish, False

    def wait(self, *timeout: Any) -> bool:
        """``timeout`` (a ``timedelta``) bounds the wait for the collective, as torch's."""
        if not self.done:
            if self.work is not None:
                self.work.wait(*timeout)
            self.finish(*timeout)
            self.done = True
        return True


def all_gather_into_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    group: Group = None,
    async_op: bool = False,
    label: str | None = None,
) -> dist.Work | None:
    """Gather equal shards into ``output`` (rank-major); message bytes = output bytes.

    ``input`` may be this rank's slot of ``output`` (in place). On gloo, whose all-gather is
    about 2x slower than its all-reduce, the gather is an all-reduce of ``output`` with the
    other ranks' slots zeroed (exact: every element is a sum of one value and zeros).
    """
    comm_counters.record("all_gather", group, _nbytes(output), label)
    call = _collective("all_gather", group, label)
    if _is_gloo(group) and output.dim() == 1 and input.dim() == 1:
        n, rank = input.numel(), get_rank(group)
        slot = output[rank * n : (rank + 1) * n]
        if slot.data_ptr() != input.data_ptr():
            slot.copy_(input)
        output[: rank * n].zero_()
        output[(rank + 1) * n :].zero_()
        return issue(call, lambda: dist.all_reduce(output, group=group, async_op=async_op))
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return issue(call, lambda: fn(output, input, group=group, async_op=async_op))


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: dist.ReduceOp.RedOpType = ReduceOp.SUM,
    group: Group = None,
    async_op: bool = False,
    label: str | None = None,
) -> dist.Work | None:
    """Reduce ``input`` across ranks, keep this rank's equal slice; bytes = input bytes.

    On gloo, whose reduce-scatter is about 2.5x slower than its all-reduce, a SUM is an
    all-to-all (each rank receives every rank's copy of its slice) plus a local sum, which
    moves the optimal (N-1)/N of the bytes.
    """
    comm_counters.record("reduce_scatter", group, _nbytes(input), label)
    call = _collective("reduce_scatter", group, label)
    if _is_gloo(group) and op == ReduceOp.SUM and input.dim() == 1:
        world = get_world_size(group)
        scratch = _scratch.take(input)
        work = issue(
            call, lambda: dist.all_to_all_single(scratch, input, group=group, async_op=True)
        )

        def finish(*_timeout: Any) -> None:
            torch.sum(scratch.view(world, -1), dim=0, out=output)
            _scratch.give(scratch)

        done = _Finish(work, finish)
        if not async_op:
            done.wait()
            return None
        return done  # type: ignore[return-value]
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return issue(call, lambda: fn(output, input, op=op, group=group, async_op=async_op))


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: Group = None,
    async_op: bool = False,
    label: str | None = None,
) -> dist.Work | None:
    """All-to-all over dim 0 of ``input``; message bytes = input bytes."""
    comm_counters.record("all_to_all", group, _nbytes(input), label)
    call = _collective("all_to_all", group, label)
    return issue(
        call,
        lambda: dist.all_to_all_single(
            output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op
        ),
    )


def broadcast(
    tensor: torch.Tensor,
    src: int,
    group: Group = None,
    async_op: bool = False,
    label: str | None = None,
) -> dist.Work | None:
    """Broadcast from global rank ``src``; message bytes = tensor bytes."""
    comm_counters.record("broadcast", group, _nbytes(tensor), label)
    call = _collective("broadcast", group, label)
    return issue(call, lambda: dist.broadcast(tensor, src=src, group=group, async_op=async_op))


def isend(
    tensor: torch.Tensor, dst: int, group: Group = None, label: str | None = None
) -> dist.Work:
    """Start sending ``tensor`` to global rank ``dst``; keep ``tensor`` alive until ``wait()``.

    Point-to-point messages between two ranks are matched in posting order (tags are not
    used: NCCL ignores them). Message bytes = tensor bytes, counted as ``send``.
    """
    comm_counters.record("send", group, _nbytes(tensor), label)
    work = issue(Call("send", group, label, None, dst), lambda: dist.isend(tensor, dst, group))
    assert work is not None
    return work


def irecv(
    tensor: torch.Tensor, src: int, group: Group = None, label: str | None = None
) -> dist.Work:
    """Start receiving into ``tensor`` from global rank ``src``; counted as ``recv``."""
    comm_counters.record("recv", group, _nbytes(tensor), label)
    work = issue(Call("recv", group, label, None, src), lambda: dist.irecv(tensor, src, group))
    assert work is not None
    return work


def send(tensor: torch.Tensor, dst: int, group: Group = None, label: str | None = None) -> None:
    """Blocking :func:`isend`."""
    isend(tensor, dst, group, label).wait()


def recv(tensor: torch.Tensor, src: int, group: Group = None, label: str | None = None) -> None:
    """Blocking :func:`irecv`."""
    irecv(tensor, src, group, label).wait()


def new_group(ranks: list[int], axis: str | None = None) -> Group:
    """A process group over global ``ranks``, labelled ``axis`` in the byte counters.

    A collective call: every rank of the world must make it, with the same ``ranks``, in the
    same order (even ranks that are not members).
    """
    if not is_initialized():
        return None
    group = dist.new_group(ranks)
    if axis is not None and group is not None and group != dist.GroupMember.NON_GROUP_MEMBER:
        register_axis(group, axis)
    return group


def barrier(group: Group = None, label: str | None = None) -> None:
    comm_counters.record("barrier", group, 0, label)
    issue(_collective("barrier", group, label), lambda: dist.barrier(group=group))


_CONTROL: dict[str, Any] = {}


def ensure_control_group() -> None:
    """Create the gloo group ``monitored_barrier`` needs when the default backend is not gloo.

    A collective call: every rank must make it (``initialize`` does, on every rank)."""
    if not is_initialized() or "group" in _CONTROL:
        return
    if dist.get_backend() == "gloo":
        _CONTROL["group"] = None  # the default group is gloo already
    else:
        _CONTROL["group"] = dist.new_group(backend="gloo")


def monitored_barrier(timeout: timedelta, what: str) -> None:
    """A barrier that names the ranks that did not arrive within ``timeout`` (any backend).

    Raises:
        PeerDiedError: "``what``: rank N died ..." when a rank's connection closed first.
        RuntimeError: "``what``: ranks [..] did not arrive within N s".
    """
    if get_world_size() == 1:
        return
    if "group" not in _CONTROL:
        raise RuntimeError(
            "monitored_barrier needs the control group: call slipstream.initialize (or "
            "comm.ensure_control_group on every rank) first"
        )
    comm_counters.record("barrier", None, 0, None)
    start = time.monotonic()
    try:
        dist.monitored_barrier(_CONTROL["group"], timeout=timeout, wait_all_ranks=True)
    except RuntimeError as e:
        found = re.findall(r"Ranks? ([\d, ]+) failed", str(e))
        missing = sorted({int(r) for r in re.findall(r"\d+", found[-1])}) if found else []
        elapsed = time.monotonic() - start
        if elapsed < 0.9 * timeout.total_seconds():  # not a timeout: the connection closed
            who = _ranks_text(missing) if missing else "a rank"
            raise PeerDiedError(
                f"{what}: {who} is gone: its connection closed {elapsed:.2f} s into the barrier, "
                f"long before the {timeout.total_seconds():.0f} s timeout (its process died, or "
                f"its script ended without calling {what}); see that rank's own error"
            ) from e
        raise RuntimeError(
            f"{what}: not every rank called it within {timeout.total_seconds():.0f} s (ranks "
            f"that did not arrive: {missing or str(e)}). {what} must be called on every rank"
        ) from e


class PeerDiedError(RuntimeError):
    """A rank's process ended while the others waited for it (not a timeout)."""


def _ranks_text(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def all_gather_object(obj: Any, group: Group = None) -> list[Any]:
    """Gather one picklable object per rank (small control messages only)."""
    out: list[Any] = [None] * get_world_size(group)
    comm_counters.record("all_gather_object", group, 0, None)
    call = _collective("all_gather_object", group, None)
    issue(call, lambda: dist.all_gather_object(out, obj, group=group))
    return out


def check_same_across_ranks(value: Any, what: str, group: Group = None) -> None:
    """Raise on every rank if ``value`` differs between ranks, naming the ranks.

    Used before collectives whose shapes depend on ``value`` so a divergence becomes an
    error instead of a hang.
    """
    if get_world_size(group) == 1:
        return
    digest = hashlib.sha256(repr(value).encode()).hexdigest()[:16]
    digests = all_gather_object(digest, group)
    if len(set(digests)) > 1:
        groups: dict[str, list[int]] = defaultdict(list)
        for r, d in enumerate(digests):
            groups[d].append(r)
        parts = "; ".join(f"ranks {ranks}" for ranks in groups.values())
        values = all_gather_object(value, group)  # the error path only: name the difference
        me = get_rank(group)
        other = next(r for r, d in enumerate(digests) if d != digests[me])
        raise RuntimeError(
            f"{what} differs between ranks (groups that agree: {parts}); "
            f"{first_difference(value, values[other], global_rank(group, me), global_rank(group, other))}. "
            f"Every rank must build the same {what}"
        )
