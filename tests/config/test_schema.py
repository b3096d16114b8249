"""Tests for the typed config models and their error helpers (defaults, bounds, aliases, messages)."""

from __future__ import annotations

import ast
import inspect
import sys
from typing import Any

import pytest
from pydantic import ValidationError

from slipstream.config import (
    BF16Config,
    ConfigError,
    DataTypesConfig,
    FP16Config,
    OffloadConfig,
    OptimizerConfig,
    SchedulerConfig,
    SlipstreamConfig,
    ZeroConfig,
    precision,
    schema,
    zero,
)
from slipstream.config._base import StrictModel, check_keys, validate_model
from slipstream.config._errors import did_you_mean, unknown_key_message
from slipstream.config.schema import NOT_YET_IMPLEMENTED, CommsLoggerConfig

# --- error helpers ---------------------------------------------------------------------------


def test_config_error_is_value_error() -> None:
    """ConfigError subclasses ValueError so ``except ValueError`` guards keep working."""
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize(
    "name, expected",
    [
        ("STAGE", "stage"),
        ("stagee", "stage"),
        ("zero_optimisation", "zero_optimization"),
        ("Initial_Scale_Pwr", "initial_scale_power"),
        ("xyzzy", None),
    ],
)
def test_did_you_mean(name: str, expected: str | None) -> None:
    """did_you_mean is case-insensitive and returns the original spelling, or None."""
    candidates = ["stage", "zero_optimization", "initial_scale_power", "overlap_comm"]
    assert did_you_mean(name, candidates) == expected


def test_unknown_key_message_with_hint() -> None:
    """The message has the dotted path, the suggestion and the fix."""
    msg = unknown_key_message("stagee", "zero_optimization", ["stage", "overlap_comm"])
    assert msg == (
        "unknown config key 'zero_optimization.stagee'; did you mean 'stage'? "
        "(remove or rename it: slipstream rejects keys it would otherwise ignore)"
    )


def test_unknown_key_message_top_level_without_hint_lists_keys() -> None:
    """Without a close match it lists the sorted valid keys, truncated after 12."""
    few = unknown_key_message("xyzzy", "", ["b", "a"])
    assert "unknown config key 'xyzzy'; valid keys here are: a, b (remove" in few
    many = unknown_key_message("xyzzy", "", [f"key{i:02d}" for i in range(20)])
    assert "valid keys here are: key00, key01," in many
    assert "key11, ... (remove" in many
    assert "key12" not in many


# --- StrictModel and validate_model -------------------------------------------------------------


def test_strict_model_forbids_extra_keys() -> None:
    """Constructing a model directly with an unknown key fails (pydantic extra="forbid")."""
    with pytest.raises(ValidationError, match="stagee"):
        ZeroConfig(stagee=2)  # type: ignore[call-arg]


def test_strict_model_validates_assignment() -> None:
    """Assigning an out-of-range value after construction fails too."""
    cfg = SlipstreamConfig()
    with pytest.raises(ValidationError):
        cfg.zero_optimization.stage = 5
    with pytest.raises(ValidationError):
        cfg.gradient_clipping = -1.0


def test_check_keys_recurses_into_nested_models() -> None:
    """check_keys reports the full dotted path of a nested unknown key."""
    with pytest.raises(
        ConfigError, match=r"'zero_optimization\.offload_param\.pin_mem'; did you mean 'pin_memory'"
    ):
        check_keys({"offload_param": {"pin_mem": True}}, ZeroConfig, "zero_optimization")


def test_check_keys_ignores_non_dict() -> None:
    """Non-dict data is left for pydantic to reject with a type error."""
    check_keys(True, FP16Config, "fp16")


def test_validate_model_joins_all_errors_with_paths() -> None:
    """Every pydantic error becomes one "config key '<path>' = <value>: <msg>" clause."""
    with pytest.raises(ConfigError) as info:
        validate_model(FP16Config, {"hysteresis": 0, "loss_scale_window": -1}, "fp16")
    msg = str(info.value)
    assert (
        "config key 'fp16.loss_scale_window' = -1: Input should be greater than or equal to 1"
        in msg
    )
    assert "config key 'fp16.hysteresis' = 0: Input should be greater than or equal to 1" in msg
    assert msg.count("; config key") == 1


def test_validate_model_without_prefix() -> None:
    """At the top level the path is just the field name."""
    with pytest.raises(ConfigError, match=r"^config key 'gradient_clipping' = -2\.0: "):
        validate_model(SlipstreamConfig, {"gradient_clipping": -2.0}, "")


def test_validate_model_missing_required_field() -> None:
    """A missing required field names its dotted path."""
    with pytest.raises(ConfigError, match=r"config key 'optimizer\.type' = .*Field required"):
        validate_model(OptimizerConfig, {"params": {}}, "optimizer")


def test_validate_model_error_is_not_chained() -> None:
    """The ConfigError hides the pydantic traceback (raised ``from None``)."""
    with pytest.raises(ConfigError) as info:
        validate_model(ZeroConfig, {"stage": 9}, "zero_optimization")
    assert info.value.__cause__ is None and info.value.__suppress_context__


# --- defaults match DeepSpeed (deepspeed-surface.md sections 2.3 to 2.5) ------------------------


def test_zero_defaults_match_deepspeed() -> None:
    """ZeroConfig defaults are DeepSpeed's, except overlap (documented as true)."""
    z = ZeroConfig()
    assert z.stage == 0
    assert z.contiguous_gradients and z.reduce_scatter and z.allgather_partitions
    assert z.reduce_bucket_size == z.allgather_bucket_size == 500_000_000
    assert z.sub_group_size == 1_000_000_000
    assert z.stage3_prefetch_bucket_size == 50_000_000
    assert z.stage3_param_persistence_threshold == 100_000
    assert z.stage3_model_persistence_threshold == sys.maxsize
    assert z.stage3_max_live_parameters == z.stage3_max_reuse_distance == 1_000_000_000
    assert not z.stage3_gather_16bit_weights_on_model_save
    assert (z.zero_hpz_partition_size, z.mics_shard_size) == (1, -1)
    assert z.offload_optimizer is None and z.offload_param is None
    assert z.overlap_comm is None and z.overlap


def test_offload_defaults_and_enabled() -> None:
    """OffloadConfig defaults are DeepSpeed's; ``enabled`` is device != "none"."""
    off = OffloadConfig()
    assert (off.device, off.buffer_count, off.buffer_size, off.max_in_cpu) == (
        "none",
        4,
        100_000_000,
        1_000_000_000,
    )
    assert off.ratio == 1.0 and not off.pin_memory and not off.enabled
    assert OffloadConfig(device="cpu").enabled and OffloadConfig(device="nvme").enabled


def test_precision_defaults_match_deepspeed() -> None:
    """fp16 uses dynamic scaling from 2**16 with window 1000 and hysteresis 2; bf16 is off."""
    fp16 = FP16Config()
    assert not fp16.enabled and fp16.loss_scale == 0.0
    assert (fp16.initial_scale_power, fp16.loss_scale_window, fp16.hysteresis) == (16, 1000, 2)
    assert fp16.min_loss_scale == 1.0 and not fp16.consecutive_hysteresis
    bf16 = BF16Config()
    assert not any(bf16.model_dump().values())
    assert DataTypesConfig().grad_accum_dtype is None


def test_top_level_defaults() -> None:
    """Top-level defaults: clip at 1.0 (DeepSpeed 0.19.8), predivide 1, managed accumulation,
    nothing enabled."""
    cfg = SlipstreamConfig()
    assert cfg.gradient_clipping == 1.0 and cfg.gradient_predivide_factor == 1.0
    assert cfg.managed_gradient_accumulation and cfg.zero_force_ds_cpu_optimizer
    assert not (cfg.prescale_gradients or cfg.sparse_gradients or cfg.wall_clock_breakdown)
    assert cfg.optimizer is None and cfg.scheduler is None and cfg.communication_data_type is None
    assert cfg.train_batch_size is None
    logger = CommsLoggerConfig()
    assert not logger.enabled and logger.prof_all and logger.prof_ops == []


# --- aliases on the models ------------------------------------------------------------------


@pytest.mark.parametrize(
    "short_name, long_name",
    [
        (field.alias, name)
        for name, field in ZeroConfig.model_fields.items()
        if field.alias is not None
    ],
)
def test_zero_short_alias_and_long_name(short_name: str, long_name: str) -> None:
    """Each stage3_* field is populated by its DeepSpeed name and by the short alias."""
    assert long_name == f"stage3_{short_name}"
    default = ZeroConfig.model_fields[long_name].default
    value = (not default) if isinstance(default, bool) else 12345
    assert getattr(ZeroConfig.model_validate({short_name: value}), long_name) == value
    assert getattr(ZeroConfig.model_validate({long_name: value}), long_name) == value


def test_bfloat16_alias_on_model() -> None:
    """``bfloat16`` populates ``bf16``; dumps use the field name ``bf16``."""
    cfg = SlipstreamConfig.model_validate({"bfloat16": {"enabled": True}})
    assert cfg.bf16.enabled
    assert "bf16" in cfg.model_dump() and "bfloat16" not in cfg.model_dump()


@pytest.mark.parametrize("model", [OptimizerConfig, SchedulerConfig])
def test_optimizer_scheduler_params_are_free_form(model: type[StrictModel]) -> None:
    """``params`` is an open dict (checked later by the builders); ``type`` is required."""
    obj: Any = model.model_validate({"type": "X", "params": {"anything": 1}})
    assert obj.params == {"anything": 1}
    assert model.model_validate({"type": "X"}).params == {}  # type: ignore[attr-defined]


# --- structure --------------------------------------------------------------------------------


def test_not_yet_implemented_keys_are_not_fields() -> None:
    """A key cannot be both a typed field and a "not yet implemented" block (it would be dropped)."""
    accepted = set(SlipstreamConfig.model_fields) | {
        f.alias for f in SlipstreamConfig.model_fields.values() if f.alias
    }
    assert not accepted & set(NOT_YET_IMPLEMENTED)


def _strict_model_classes() -> list[type]:
    classes = []
    for module in (zero, precision, schema):
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, StrictModel) and obj.__module__ == module.__name__:
                classes.append(obj)
    return classes


@pytest.mark.parametrize("cls", _strict_model_classes(), ids=lambda c: c.__name__)
def test_every_field_has_a_docstring(cls: type) -> None:
    """STYLE.md: each config field carries a docstring (the string right after it)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    assert cls.__doc__, f"{cls.__name__} has no class docstring"
    missing = []
    for i, node in enumerate(body):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            nxt = body[i + 1] if i + 1 < len(body) else None
            documented = isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
            if not documented:
                missing.append(node.target.id)
    missing = [m for m in missing if m != "model_config"]
    assert not missing, f"{cls.__name__} fields without a docstring: {missing}"


def test_strict_model_base_config() -> None:
    """The shared base forbids extras, validates assignment and accepts field names and aliases."""
    conf = StrictModel.model_config
    assert conf.get("extra") == "forbid"
    assert conf.get("validate_assignment") is True
    assert conf.get("populate_by_name") is True
