"""Config types are strict, the same way everywhere: no string-to-number, number-to-bool or
bool-to-number conversion; the error names the key, the value and the expected type."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from slipstream.config import ConfigError, parse_config
from slipstream.config._base import StrictModel, _nested_model, _wants_int
from slipstream.config.schema import SlipstreamConfig
from slipstream.optim import build_optimizer, build_scheduler
from tests.config._helpers import BATCH_KEYS, _cfg, _error, _nested

INT, NUMBER, BOOL = "expected an integer", "expected a number", "expected true or false"


@pytest.mark.parametrize(
    "dotted, value, expected",
    [
        ("zero_optimization.stage", True, f"{INT}, got a boolean"),
        ("zero_optimization.stage", "2", f"{INT}, got a string; write the number without quotes"),
        ("zero_optimization.stage", 1.5, f"{INT}, got a number with a fractional part"),
        ("zero_optimization.reduce_bucket_size", "5e8", f"{INT}, got a string"),
        ("zero_optimization.overlap_comm", 1, f"{BOOL}, got an integer"),
        ("zero_optimization.offload_optimizer.pin_memory", "true", f"{BOOL}, got a string"),
        ("zero_optimization.offload_optimizer.device", 1, "Input should be 'none', 'cpu'"),
        ("fp16.enabled", "yes", f"{BOOL}, got a string; write true or false without quotes"),
        ("bf16.enabled", 1, f"{BOOL}, got an integer; write true or false, not a number"),
        ("bf16.enabled", 0, f"{BOOL}, got an integer"),
        ("fp16.loss_scale", "128", f"{NUMBER}, got a string"),
        ("fp16.initial_scale_power", False, f"{INT}, got a boolean"),
        ("gradient_clipping", "1.0", f"{NUMBER}, got a string; write the number without quotes"),
        ("gradient_clipping", True, f"{NUMBER}, got a boolean; true/false is not a number"),
        ("steps_per_print", "10", f"{INT}, got a string"),
        ("seed", "42", f"{INT}, got a string"),
        ("wall_clock_breakdown", "false", f"{BOOL}, got a string"),
        ("communication_data_type", 16, "Input should be 'fp32', 'fp16' or 'bf16'"),
        ("comms_logger.prof_ops", "all_reduce", "expected a list, got a string"),
        ("checkpoint.barrier_timeout", "30", f"{NUMBER}, got a string"),
        ("checkpoint.keep_last", True, f"{INT}, got a boolean"),
        ("pipeline.virtual_stages", "2", f"{INT}, got a string"),
        ("tensor_parallel.autotp_size", 2.5, f"{INT}, got a number with a fractional part"),
        ("tensor_parallel.tp_overlap_comm", 0, f"{BOOL}, got an integer"),
        ("activation_checkpointing.cpu_checkpointing", 1, f"{BOOL}, got an integer"),
        ("optimizer.type", 3, "expected a string, got an integer"),
        ("optimizer.params", [1e-3], "expected an object ({...}), got a list"),
        ("nonfinite_gradients", "raise", "Input should be 'skip' or 'error'"),
        ("tensorboard.enabled", "false", f"{BOOL}, got a string"),
        ("train_batch_size", "8", "must be a positive integer"),
        ("train_micro_batch_size_per_gpu", True, "must be a positive integer"),
    ],
    ids=lambda v: repr(v) if not isinstance(v, str) else v,
)
def test_wrong_type_is_rejected_naming_key_value_and_type(
    dotted: str, value: Any, expected: str
) -> None:
    """Each wrong-type value is an error with the dotted key, the value and the expected type."""
    _error(_cfg(**_nested(dotted, value)), f"config key '{dotted}' = {value!r}", expected)


@pytest.mark.parametrize(
    "dotted, value, parsed",
    [
        ("gradient_clipping", 1, 1.0),  # JSON has one number type: an int is a float
        ("fp16.loss_scale", 128, 128.0),
        ("zero_optimization.reduce_bucket_size", 5e8, 500_000_000),  # DeepSpeed's 5e8 style
        ("zero_optimization.stage3_max_reuse_distance", 1e9, 1_000_000_000),
        ("autotuning.model_info.num_params", 1.3e9, 1_300_000_000),
        ("tensor_parallel.tp_overlap_comm", False, False),
    ],
)
def test_json_number_forms_are_accepted(dotted: str, value: Any, parsed: Any) -> None:
    """Ints stand for floats, and integral floats for element counts (DeepSpeed's 5e8 style),
    with the field's own type after."""
    cfg: Any = parse_config(_cfg(**_nested(dotted, value)))
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    assert cfg == parsed and type(cfg) is type(parsed)


def _integer_keys(model: type[StrictModel], where: str = "") -> list[tuple[str, bool]]:
    """Every integer key under ``model`` (dotted field names; the aliases are DeepSpeed's
    short forms) and whether it is an element count that takes DeepSpeed's 5e8 style."""
    keys = []
    for name, field in model.model_fields.items():
        key = f"{where}{name}"
        nested = _nested_model(field.annotation)
        if nested is not None:
            keys += _integer_keys(nested, key + ".")
        elif _wants_int(field.annotation):
            keys.append((key, name in model.e_notation))
    return keys


_INTEGER_KEYS = _integer_keys(SlipstreamConfig)


def test_every_integer_key_is_covered() -> None:
    """The walk below finds the schema's integer keys, batch sizes and ZeRO's included."""
    keys = dict(_INTEGER_KEYS)
    assert keys["zero_optimization.stage"] is False and keys["checkpoint.keep_last"] is False
    assert keys["zero_optimization.reduce_bucket_size"] is True and len(keys) > 40


@pytest.mark.parametrize("dotted", [k for k, e in _INTEGER_KEYS if not e] + list(BATCH_KEYS))
def test_integral_float_for_an_integer_key_is_refused(dotted: str) -> None:
    """Issue 38: ``"stage": 2.0`` was accepted. No integer key other than an element count
    takes a float: the error names the key, the value and the fix."""
    try:
        parse_config(_cfg(**_nested(dotted, 2)))
    except ConfigError:  # a key refused with any value (a DeepSpeed feature not supported)
        _error(_cfg(**_nested(dotted, 2.0)))
        return
    msg = _error(_cfg(**_nested(dotted, 2.0)), f"config key '{dotted}' = 2.0")
    assert "expected an integer" in msg or "must be a positive integer" in msg, msg
    assert "write 2" in msg, msg


@pytest.mark.parametrize("dotted", [k for k, e in _INTEGER_KEYS if e])
def test_element_counts_take_an_integral_float(dotted: str) -> None:
    """The element and byte counts DeepSpeed's configs write as 5e8 take an integral float
    (and still refuse a fractional one)."""
    cfg: Any = parse_config(_cfg(**_nested(dotted, 2e3)))
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    assert cfg == 2000 and type(cfg) is int
    _error(_cfg(**_nested(dotted, 2.5)), f"config key '{dotted}' = 2.5", "fractional part")


@pytest.mark.parametrize(
    "section, type_name, params, expected",
    [
        ("optimizer", "AdamW", {"lr": "fast"}, "'optimizer.params.lr' = 'fast': expected a number"),
        ("optimizer", "Lion", {"lr": True}, "'optimizer.params.lr' = True: expected a number"),
        ("optimizer", "AdamW", {"betas": [0.9, "0.99"]}, "expected a list of numbers"),
        ("optimizer", "AdamW", {"amsgrad": "true"}, "'optimizer.params.amsgrad' = 'true'"),
        ("optimizer", "SGD", {"lr": 0.1, "nesterov": 1}, "expected true or false"),
        ("scheduler", "WarmupLR", {"warmup_num_steps": "10"}, "expected a number, got a string"),
        ("scheduler", "WarmupLR", {"warmup_type": 1}, "expected a string, got an integer"),
        ("scheduler", "StepLR", {"step_size": 2, "gamma": "0.5"}, "'scheduler.params.gamma'"),
    ],
)
def test_optimizer_and_scheduler_param_types(
    section: str, type_name: str, params: dict[str, Any], expected: str
) -> None:
    """Optimizer and scheduler params are checked against the type of the constructor's
    default (no more "'<=' not supported between 'float' and 'str'" from inside torch)."""
    weights = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ConfigError, match="config key") as info:
        if section == "optimizer":
            build_optimizer(type_name, params, weights)
        else:
            build_scheduler(type_name, params, build_optimizer("SGD", {"lr": 0.1}, weights))
    assert expected in str(info.value)
    assert "not supported between" not in str(info.value)


def test_numeric_optimizer_params_accept_ints_and_per_group_lists() -> None:
    """``"lr": 1`` and SGD's ``momentum: float = 0`` default take any JSON number; DeepSpeed
    schedules take one lr per param group."""
    weights = [torch.nn.Parameter(torch.zeros(2))]
    opt = build_optimizer("SGD", {"lr": 1, "momentum": 0.9}, weights)
    assert opt.param_groups[0]["lr"] == 1
    build_scheduler("WarmupLR", {"warmup_min_lr": [0.0], "warmup_num_steps": 1e3}, opt)


# --- the four weak messages of issue 19 -------------------------------------------------------


@pytest.mark.parametrize("config", [42, 1.5, None, ["train_batch_size"]], ids=repr)
def test_config_of_wrong_kind_names_it(config: Any) -> None:
    """``config=42`` is a ConfigError naming the value and what to pass, not a raw TypeError."""
    _error(config, f"config = {config!r} ({type(config).__name__}) is not a config: pass a dict")


def test_directory_path_says_directory(tmp_path: Path) -> None:
    """A directory is named as one (it exists), with the fix."""
    _error(str(tmp_path), f"config path '{tmp_path}' is a directory: pass the JSON/HJSON file")
    _error(tmp_path, "is a directory")


@pytest.mark.parametrize("text", ["", "  \n\t\n"], ids=["empty", "whitespace"])
def test_empty_file_says_empty(tmp_path: Path, text: str) -> None:
    """An empty file says so instead of "batch size is missing"."""
    path = tmp_path / "ds_config.json"
    path.write_text(text)
    msg = _error(str(path), f"config file '{path}' is empty")
    assert "batch size is missing" not in msg


def test_non_utf8_file_names_path(tmp_path: Path) -> None:
    """A binary file is a ConfigError with the path, not a UnicodeDecodeError."""
    path = tmp_path / "ds_config.json"
    path.write_bytes(b"\xff\xfe{\x00")
    _error(str(path), f"config file '{path}' is not UTF-8 text")
