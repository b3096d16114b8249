"""Every rank learns the outcome of every checkpoint phase (a failure anywhere is an error
everywhere, at once).

After a phase, the ranks exchange one small report each (``None`` or the error's message)
with ``comm.all_gather_object``: one control message per rank and phase, the cost of a
barrier. Where any rank failed, every rank raises the same ``CheckpointError`` naming the
failing ranks and their messages (chained to the original on the ranks that had it), so a
script that catches it on every rank goes on in step instead of leaving the healthy ranks in
the next collective until the collective timeout (``SLIPSTREAM_COMM_TIMEOUT``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from slipstream.checkpoint.format import CheckpointError
from slipstream.distributed import comm

__all__ = ["on_every_rank", "on_rank0", "raise_if_failed"]

T = TypeVar("T")


def _describe(error: BaseException) -> str:
    if isinstance(error, CheckpointError):
        return str(error)
    return f"{type(error).__name__}: {error}"


def raise_if_failed(what: str, error: BaseException | None, payload: Any = None) -> list[Any]:
    """Agree on the outcome of phase ``what``; returns every rank's ``payload``.

    Raises:
        CheckpointError: on every rank when ``what`` failed on any rank, naming the ranks
            and their messages (chained to the original error on the ranks that had it).
    """
    report = None if error is None else _describe(error)
    if comm.get_world_size() == 1:
        outcomes = [(report, payload)]
    else:
        try:
            outcomes = comm.all_gather_object((report, payload))
        except RuntimeError as e:  # a peer died: the transport error is all there is to say
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CheckpointError(
                f"{what}: the ranks could not agree on its outcome, a rank probably died or "
                f"left the job ({first})"
            ) from (error or e)
    failed = {r: m for r, (m, _) in enumerate(outcomes) if m is not None}
    if not failed:
        return [p for _, p in outcomes]
    if (len(outcomes) == 1 and isinstance(error, CheckpointError)) or (
        error is not None and not isinstance(error, Exception)  # e.g. KeyboardInterrupt
    ):
        raise error
    messages = set(failed.values())
    if len(failed) == 1:
        ((rank, message),) = failed.items()
        detail = f"rank {rank}: {message}"
    elif len(messages) == 1:
        detail = f"ranks {sorted(failed)}: {messages.pop()}"
    else:
        detail = f"ranks {sorted(failed)}: " + "; ".join(
            f"rank {r}: {m}" for r, m in failed.items()
        )
    raise CheckpointError(f"{what} failed on {detail}") from error


def on_every_rank(what: str, fn: Callable[[], T]) -> T:
    """``fn()`` on every rank; if it raises anywhere, a ``CheckpointError`` everywhere."""
    value: Any = None
    error: Exception | None = None
    try:
        value = fn()
    except Exception as e:  # shared with the other ranks, then re-raised on all of them
        error = e
    raise_if_failed(what, error)
    return value  # type: ignore[no-any-return]


def on_rank0(what: str, fn: Callable[[], T]) -> T:
    """``fn()`` on rank 0, its result on every rank (small picklable values); if it raises,
    a ``CheckpointError`` everywhere."""
    value: Any = None
    error: Exception | None = None
    if comm.get_rank() == 0:
        try:
            value = fn()
        except Exception as e:  # shared with the other ranks, then re-raised on all of them
            error = e
    return raise_if_failed(what, error, value)[0]  # type: ignore[no-any-return]
