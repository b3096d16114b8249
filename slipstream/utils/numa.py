"""``deepspeed.utils.numa``: the core-list syntax of ``--bind_core_list``.

``parse_range_list("0,2-4,6")`` is ``[0, 2, 3, 4, 6]``: comma-separated cores or inclusive
``a-b`` ranges, ascending and not overlapping. slipstream's launcher binds cores itself
(``slipstream run --bind_cores_to_rank``), with the same syntax.
"""

from __future__ import annotations

__all__ = ["parse_range", "parse_range_list"]


def parse_range(rng: str) -> range:
    """``"5"`` is ``range(5, 6)``, ``"2-4"`` is ``range(2, 5)``.

    Raises:
        ValueError: not a number nor ``a-b`` with ``a <= b``.
    """
    if rng.lstrip("-").isdigit():
        value = int(rng)
        return range(value, value + 1)
    parts = rng.split("-")
    if len(parts) != 2:
        raise ValueError(
            f"Bad range: '{rng}', range must be either a number or two numbers separated by a dash"
        )
    start, end = int(parts[0]), int(parts[1])
    if start > end:
        raise ValueError(f"Bad range: '{rng}', range end must be larger than or equal to start")
    return range(start, end + 1)


def parse_range_list(range_str: str) -> list[int]:
    """The cores of a comma-separated list of :func:`parse_range` items.

    Raises:
        ValueError: a bad item, or items out of ascending order or overlapping.
    """
    cores: list[int] = []
    for item in range_str.split(","):
        sub = parse_range(item)
        if cores and sub[0] <= cores[-1]:
            raise ValueError(
                f"Bad range: '{range_str}', sub ranges must not overlap with each other and "
                "should be in ascending order"
            )
        cores.extend(sub)
    return cores
