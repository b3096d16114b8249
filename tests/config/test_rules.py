"""Cross-field config rules: precision, ZeRO stages and ZeRO++ keys, offload, features not implemented yet."""

from __future__ import annotations

import warnings
from typing import Any

import pytest

from slipstream.config import (
    parse_config,
)
from slipstream.config.schema import NOT_YET_IMPLEMENTED
from tests.config._helpers import _cfg, _error

# --- cross-field rules and features of later issues ------------------------------------------


def test_fp16_and_bf16_both_enabled_rejected() -> None:
    """fp16 and bf16 together are an error naming both keys."""
    _error(
        _cfg(fp16={"enabled": True}, bf16={"enabled": True}),
        "fp16.enabled and bf16.enabled are both true: choose one precision",
    )


def test_stage_3_accepted() -> None:
    """ZeRO stage 3 parses."""
    assert parse_config(_cfg(zero_optimization={"stage": 3})).zero_optimization.stage == 3


def test_stage_out_of_range_rejected() -> None:
    """A stage above 3 is a value error on the dotted key."""
    _error(
        _cfg(zero_optimization={"stage": 4}),
        "config key 'zero_optimization.stage' = 4: Input should be less than or equal to 3",
    )


@pytest.mark.parametrize(
    "key, value",
    [
        ("zero_quantized_weights", True),
        ("zero_quantized_nontrainable_weights", True),
        ("zero_quantized_gradients", True),
        ("zero_hpz_partition_size", 8),
    ],
)
def test_zeropp_keys_need_stage_3(key: str, value: Any) -> None:
    """ZeRO++ options work on ZeRO-3 only; at stage 2 the error names the key and the fix."""
    _error(
        _cfg(zero_optimization={"stage": 2, key: value}),
        f"zero_optimization.{key} (ZeRO++) works with stage 3, but stage = 2",
    )


def test_zeropp_odd_grad_block() -> None:
    _error(
        _cfg(zero_optimization={"stage": 3, "zero_quantized_gradients_block_size": 511}),
        "must be even",
    )


def test_zeropp_keys_at_defaults_accepted() -> None:
    """ZeRO++ keys at their off values are fine (DeepSpeed configs often spell them out)."""
    zero = {
        "stage": 2,
        "zero_quantized_weights": False,
        "zero_quantized_gradients": False,
        "zero_hpz_partition_size": 1,
    }
    assert parse_config(_cfg(zero_optimization=zero)).zero_optimization.stage == 2


def test_offload_param_nvme_refused_none_accepted() -> None:
    """Parameter offload to NVMe is refused (CPU works); device "none" is accepted."""
    _error(
        _cfg(zero_optimization={"stage": 3, "offload_param": {"device": "nvme"}}),
        "zero_optimization.offload_param.device = 'nvme' is not implemented yet",
    )
    cfg = parse_config(_cfg(zero_optimization={"stage": 3, "offload_param": {"device": "none"}}))
    assert not cfg.zero_optimization.offload_param.enabled


def test_offload_optimizer_nvme_needs_a_path() -> None:
    """NVMe optimizer offload needs nvme_path; with it the block is accepted."""
    _error(
        _cfg(zero_optimization={"stage": 2, "offload_optimizer": {"device": "nvme"}}),
        "offload_optimizer.device = 'nvme' needs nvme_path",
    )
    zero = {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/swap"}}
    assert parse_config(_cfg(zero_optimization=zero)).zero_optimization.offload_optimizer.enabled


@pytest.mark.parametrize(
    "config, fragment",
    [
        ({"zero_optimization": {"mics_shard_size": 4}}, "zero_optimization.mics_shard_size (MiCS)"),
        ({"sparse_gradients": True}, "sparse_gradients = true is not supported"),
        (
            {"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}},
            "fp16.fp16_master_weights_and_grads is not implemented yet",
        ),
    ],
    ids=["mics", "sparse_gradients", "fp16_master_weights"],
)
def test_unsupported_options_rejected(config: dict[str, Any], fragment: str) -> None:
    """Options slipstream does not support are errors naming the key, never silent drops."""
    _error(_cfg(**config), fragment)


@pytest.mark.parametrize(
    "bf16", [{"bf16_master_weights_and_grads": True}, {"bf16_optimizer_states": True}]
)
def test_bf16_master_weights_and_optimizer_states_must_match(bf16: dict[str, bool]) -> None:
    """bf16 master weights and bf16 optimizer states must be set together."""
    master = bf16.get("bf16_master_weights_and_grads", False)
    states = bf16.get("bf16_optimizer_states", False)
    _error(
        _cfg(bf16={"enabled": True, **bf16}),
        f"bf16.bf16_master_weights_and_grads = {master} and bf16.bf16_optimizer_states = {states}",
        "set both to the same value",
    )


def test_bf16_master_weights_with_optimizer_states_accepted() -> None:
    """Both bf16 flags together are accepted."""
    bf16 = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    cfg = parse_config(_cfg(bf16=bf16))
    assert cfg.bf16.bf16_master_weights_and_grads and cfg.bf16.bf16_optimizer_states


@pytest.mark.parametrize("key", sorted(NOT_YET_IMPLEMENTED))
def test_not_yet_implemented_block_disabled_is_dropped(key: str) -> None:
    """A known-but-unimplemented block that is disabled is accepted and dropped."""
    cfg = parse_config(_cfg(**{key: {"enabled": False}}))
    assert key not in cfg.model_dump()


@pytest.mark.parametrize("key", sorted(NOT_YET_IMPLEMENTED))
def test_not_yet_implemented_block_enabled_is_rejected(key: str) -> None:
    """An enabled known-but-unimplemented block is an error naming the key and the reason."""
    _error(
        _cfg(**{key: {"enabled": True}}),
        f"config key '{key}' = {{'enabled': True}} cannot be honoured: {NOT_YET_IMPLEMENTED[key]}",
        f"Remove '{key}'",
    )


@pytest.mark.parametrize(
    "key, value",
    [
        ("tensorboard", {"enabled": False, "output_path": "logs/", "job_name": "run"}),
        ("wandb", None),
        ("memory_breakdown", False),
        ("flops_profiler", {}),
        ("sequence_parallel_size", 1),
        ("data_parallel_size", "auto"),
    ],
)
def test_not_yet_implemented_trivial_values_accepted(key: str, value: Any) -> None:
    """Disabled, empty, null or trivial values of unimplemented keys are accepted."""
    assert parse_config(_cfg(**{key: value})).batch == (2, 2, 1)


@pytest.mark.parametrize(
    "key, value, fragment",
    [
        ("amp", {"enabled": True, "opt_level": "O1"}, "use bf16 or fp16"),
    ],
)
def test_not_yet_implemented_scalar_values_rejected(key: str, value: Any, fragment: str) -> None:
    """Non-trivial values of unimplemented keys name the key, the value and why."""
    _error(_cfg(**{key: value}), f"config key '{key}' = {value!r} cannot be honoured", fragment)


# --- non-finite gradients (issue 19, item 6) -------------------------------------------------


@pytest.mark.parametrize(
    "blocks",
    [{}, {"bf16": {"enabled": True}}, {"fp16": {"enabled": True, "loss_scale": 128}}],
    ids=["fp32", "bf16", "fp16-static"],
)
def test_nonfinite_gradients_error_accepted_without_dynamic_scaling(blocks: dict) -> None:
    """ "error" is accepted wherever a non-finite norm is not part of loss scaling."""
    assert parse_config(_cfg(**blocks)).nonfinite_gradients == "skip"
    cfg = parse_config(_cfg(nonfinite_gradients="error", **blocks))
    assert cfg.nonfinite_gradients == "error"


def test_nonfinite_gradients_error_refused_with_dynamic_fp16() -> None:
    """Dynamic fp16 scaling overflows by design, so "error" there is a config error."""
    _error(
        _cfg(nonfinite_gradients="error", fp16={"enabled": True}),
        "config key 'nonfinite_gradients' = 'error' with fp16 dynamic loss scaling",
    )


def test_bf16_check_grad_overflow_false_warns_that_the_check_stays() -> None:
    """DeepSpeed's opt-out cannot turn the check off; saying so beats a silent drop."""
    with pytest.warns(UserWarning, match=r"'bf16.check_grad_overflow' = false is not honoured"):
        parse_config(_cfg(bf16={"enabled": True, "check_grad_overflow": False}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parse_config(_cfg(bf16={"enabled": True, "check_grad_overflow": True}))
