"""``deepspeed.utils.timer``: ``trim_mean``, the outlier-trimmed mean DeepSpeed's comms logger
reports. slipstream's step timers are ``slipstream.runtime.timers`` (``wall_clock_breakdown``).
"""

from __future__ import annotations

from collections.abc import Sequence
from statistics import mean

__all__ = ["trim_mean"]


def trim_mean(data: Sequence[float], trim_percent: float) -> float:
    """The mean of ``data`` without its ``round(n * trim_percent)`` smallest and largest
    values (0 for no data). ``data`` is not modified.

    Raises:
        ValueError: ``trim_percent`` outside [0, 1].
    """
    if not 0.0 <= trim_percent <= 1.0:
        raise ValueError(f"trim_mean: trim_percent={trim_percent} must be in [0, 1]")
    n = len(data)
    if n == 0:
        return 0
    k = round(n * trim_percent)
    return mean(sorted(data)[k : n - k])
