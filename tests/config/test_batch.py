"""The batch triple (train_batch_size = micro batch x accumulation steps x data-parallel size): inference, consistency and errors."""

from __future__ import annotations

from typing import Any

import pytest

from slipstream.config import (
    ConfigError,
    parse_config,
    resolve_batch_sizes,
)
from tests.config._helpers import BATCH_KEYS, _error

# --- batch triple ----------------------------------------------------------------------------


@pytest.mark.parametrize("dp", [1, 2, 4])
@pytest.mark.parametrize(
    "given, expected",
    [
        (
            {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
            lambda dp: (8 * dp, 4, 2),
        ),
        (
            {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2},
            lambda dp: (32, 2, 16 // dp),
        ),
        ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, lambda dp: (32, 16 // dp, 2)),
        ({"train_micro_batch_size_per_gpu": 4}, lambda dp: (4 * dp, 4, 1)),
        ({"train_batch_size": 16}, lambda dp: (16, 16 // dp, 1)),
    ],
    ids=["micro+gas", "tbs+micro", "tbs+gas", "micro-only", "tbs-only"],
)
def test_batch_triple_inferred(given: dict[str, int], expected: Any, dp: int) -> None:
    """Any two of the batch keys determine the third; one key alone implies gas = 1."""
    cfg = parse_config(given, dp_world_size=dp)
    assert cfg.batch == expected(dp)
    tbs, mb, gas = cfg.batch
    assert tbs == mb * gas * dp


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_batch_triple_all_three_consistent(dp: int) -> None:
    """All three given and consistent for the world size are kept as given."""
    given = {
        "train_batch_size": 3 * 2 * dp,
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": 2,
    }
    assert parse_config(given, dp_world_size=dp).batch == (6 * dp, 3, 2)


def test_batch_triple_all_three_inconsistent() -> None:
    """Inconsistent sizes name all three values, the world size, the product and the fix."""
    given = {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
    }
    _error(
        given,
        "batch sizes do not multiply out",
        "8 != 2 * 1 * 2",
        "train_batch_size=8",
        "train_micro_batch_size_per_gpu=2",
        "gradient_accumulation_steps=1",
        "data-parallel world size=2",
        "Fix: set train_batch_size to 4",
        dp_world_size=2,
    )


@pytest.mark.parametrize(
    "given, dp, fragments",
    [
        (
            {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4},
            1,
            [
                "train_batch_size 10 is not divisible by train_micro_batch_size_per_gpu * world size = 4 * 1",
                "multiple of 4",
            ],
        ),
        (
            {"train_batch_size": 12, "train_micro_batch_size_per_gpu": 4},
            2,
            ["= 4 * 2", "data-parallel world size=2", "multiple of 8"],
        ),
        (
            {"train_batch_size": 10, "gradient_accumulation_steps": 4},
            1,
            [
                "train_batch_size 10 is not divisible by gradient_accumulation_steps * world size = 4 * 1",
                "multiple of 4",
            ],
        ),
        (
            {"train_batch_size": 6},
            4,
            ["gradient_accumulation_steps * world size = 1 * 4", "multiple of 4"],
        ),
    ],
    ids=["tbs+micro", "tbs+micro-dp2", "tbs+gas", "tbs-only-dp4"],
)
def test_batch_triple_not_divisible(given: dict[str, int], dp: int, fragments: list[str]) -> None:
    """A train_batch_size that does not divide evenly is a clear error, never a truncation."""
    _error(given, *fragments, dp_world_size=dp)


@pytest.mark.parametrize(
    "given", [{}, {"gradient_accumulation_steps": 4}], ids=["none", "gas-only"]
)
def test_batch_size_missing(given: dict[str, int]) -> None:
    """Without train_batch_size or the micro batch the error says which keys to set."""
    _error(
        given,
        "batch size is missing",
        "set train_micro_batch_size_per_gpu (and optionally gradient_accumulation_steps) or train_batch_size",
    )


@pytest.mark.parametrize("auto_key", BATCH_KEYS)
@pytest.mark.parametrize("dp", [1, 2, 4])
def test_batch_auto_key_inferred_from_other_two(auto_key: str, dp: int) -> None:
    """One batch key set to "auto" is inferred from the other two."""
    given: dict[str, Any] = {
        "train_batch_size": 4 * 2 * dp,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
    }
    given[auto_key] = "auto"
    assert parse_config(given, dp_world_size=dp).batch == (8 * dp, 4, 2)


def test_batch_all_auto_is_error() -> None:
    """All three batch keys "auto" cannot be resolved (there is no trainer to fill them)."""
    _error(dict.fromkeys(BATCH_KEYS, "auto"), "batch size is missing")


@pytest.mark.parametrize("key", BATCH_KEYS)
@pytest.mark.parametrize("value", [0, -4, 2.5, "8", True, [8]], ids=repr)
def test_batch_value_must_be_positive_integer(key: str, value: Any) -> None:
    """Zero, negatives, fractions, strings and booleans are rejected naming key and value."""
    config = {"train_micro_batch_size_per_gpu": 2, key: value}
    _error(config, f"config key '{key}' = {value!r} must be a positive integer")


def test_batch_integral_float_refused() -> None:
    """Issue 38: an integral float (JSON ``64.0`` or ``6.4e1``) is refused with the fix, as
    every integer key that is not an element count (no coercion)."""
    _error({"train_batch_size": 6.4e1, "train_micro_batch_size_per_gpu": 8},
           "config key 'train_batch_size' = 64.0 must be a positive integer (write 64)")  # fmt: skip


def test_resolve_batch_sizes_function() -> None:
    """The public helper returns (train_batch_size, micro, gas)."""
    assert resolve_batch_sizes(None, 4, 2, dp_world_size=2) == (16, 4, 2)
    assert resolve_batch_sizes(64, None, None, dp_world_size=4) == (64, 16, 1)
    with pytest.raises(ConfigError, match="do not multiply out"):
        resolve_batch_sizes(10, 4, 2, dp_world_size=1)
