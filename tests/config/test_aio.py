"""The aio block (DeepSpeed's NVMe I/O tuning): accepted at DeepSpeed's defaults, as
Lightning's DeepSpeedStrategy writes it; a value that cannot act in slipstream is refused by
key with the reason; types and unknown keys are checked."""

from __future__ import annotations

import pytest

from slipstream.config import ConfigError, parse_config

LIGHTNING_AIO = {  # what lightning.pytorch.strategies.DeepSpeedStrategy writes by default
    "block_size": 1048576,
    "queue_depth": 8,
    "single_submit": False,
    "overlap_events": True,
    "thread_count": 1,
}


def _parse(aio: object) -> object:
    return parse_config({"train_batch_size": 2, "aio": aio})


def test_lightnings_block_and_deepspeeds_full_defaults_are_accepted() -> None:
    assert _parse(LIGHTNING_AIO).aio.queue_depth == 8  # type: ignore[attr-defined]
    full = {**LIGHTNING_AIO, "intra_op_parallelism": 1, "use_gds": False}
    assert _parse(full).aio.use_gds is False  # type: ignore[attr-defined]
    assert _parse({}).aio.block_size == 1048576  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("key", "value", "why"),
    [
        ("block_size", 4096, "in one call"),
        ("queue_depth", 32, "one request in flight"),
        ("intra_op_parallelism", 4, "one thread"),
        ("thread_count", 2, "one thread"),
        ("single_submit", True, "no batched requests"),
        ("overlap_events", False, "nothing to overlap"),
        ("use_gds", True, "GPUDirect Storage"),
    ],
)
def test_a_value_that_cannot_act_is_refused_with_the_reason(
    key: str, value: object, why: str
) -> None:
    with pytest.raises(ConfigError, match=rf"aio\.{key}' = {value!r} cannot act") as err:
        _parse({key: value})
    assert why in str(err.value)


def test_types_and_unknown_keys() -> None:
    with pytest.raises(ConfigError, match=r"aio\.queue_depth"):
        _parse({"queue_depth": "8"})
    with pytest.raises(ConfigError, match="did you mean 'block_size'"):
        _parse({"blocksize": 1048576})
