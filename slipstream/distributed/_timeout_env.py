"""The collective-timeout setting's name and default, without torch: the ``slipstream``
command's help shows them before anything heavy is imported."""

from __future__ import annotations

__all__ = ["COMM_TIMEOUT_ENV", "DEFAULT_COMM_TIMEOUT_S"]

COMM_TIMEOUT_ENV = "SLIPSTREAM_COMM_TIMEOUT"
DEFAULT_COMM_TIMEOUT_S = 600.0
"""Ten minutes, as torch's own NCCL default: a stalled rank ends the job in minutes, not half
an hour (DeepSpeed's 30 min), while legitimate skew (first-step compilation, a slow rank-0
log or eval, a checkpoint on a slow filesystem) stays far below it. Jobs with a longer
one-rank phase (rank-0-only dataset preparation before a barrier) raise it."""
