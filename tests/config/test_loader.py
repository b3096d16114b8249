"""Tests for the DeepSpeed config loader: input forms, unknown keys, deprecated aliases, typed values, the example configs."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest

from slipstream.config import (
    ConfigError,
    SlipstreamConfig,
    load_config,
    parse_config,
)
from tests.config._helpers import EXAMPLES, _b64, _cfg, _error, _full_auto, _nested

# --- input forms -----------------------------------------------------------------------------


def test_dict_input_is_copied_not_mutated() -> None:
    """Aliases and batch keys are rewritten on a copy; the caller's dict is left as it was."""
    raw = {"train_batch_size": 8, "bfloat16": {"enabled": True}, "zero_optimization": True}
    before = json.loads(json.dumps(raw))
    with pytest.warns(DeprecationWarning):
        cfg = parse_config(raw, dp_world_size=2)
    assert raw == before
    assert cfg.bf16.enabled and cfg.zero_optimization.stage == 1


@pytest.mark.parametrize("as_path", [str, Path], ids=["str", "pathlike"])
def test_json_file_path(as_path: Any) -> None:
    """A JSON file is read from a str path or an os.PathLike."""
    cfg = parse_config(as_path(EXAMPLES / "zero2_bf16.json"), dp_world_size=2)
    assert cfg.batch == (64, 8, 4)
    assert cfg.bf16.enabled and not cfg.fp16.enabled
    assert cfg.zero_optimization.stage == 2


def test_hjson_file_with_comments_equals_json() -> None:
    """The HJSON example (comments, unquoted keys, 5e8 floats) parses to the JSON example."""
    from_hjson = parse_config(EXAMPLES / "zero2_bf16.hjson", dp_world_size=2)
    from_json = parse_config(EXAMPLES / "zero2_bf16.json", dp_world_size=2)
    assert from_hjson.model_dump() == from_json.model_dump()
    assert from_hjson.zero_optimization.reduce_bucket_size == 500_000_000
    assert isinstance(from_hjson.zero_optimization.reduce_bucket_size, int)


def test_load_config_returns_plain_dict() -> None:
    """load_config returns the file's JSON as a dict, untouched (no alias or batch rewriting)."""
    path = EXAMPLES / "zero1_fp16.json"
    assert load_config(path) == json.loads(path.read_text())


def test_base64_json_string() -> None:
    """A base64-encoded JSON string (DeepSpeed's third input form) is decoded."""
    cfg = parse_config(_b64({"train_batch_size": 16, "bf16": {"enabled": True}}), dp_world_size=4)
    assert cfg.batch == (16, 4, 1)
    assert cfg.bf16.enabled


def test_base64_urlsafe_string_like_deepspeed() -> None:
    """A URL-safe base64 config (what DeepSpeedConfig decodes) is accepted."""
    raw = {"train_micro_batch_size_per_gpu": 4, "wandb": {"enabled": False, "project": "llama~sft"}}
    encoded = base64.urlsafe_b64encode(json.dumps(raw).encode()).decode()
    assert "-" in encoded or "_" in encoded
    assert parse_config(encoded).batch == (4, 4, 1)


def test_slipstream_config_object_input() -> None:
    """A SlipstreamConfig is re-validated and resolved into a new object; the input is kept."""
    given = SlipstreamConfig(train_micro_batch_size_per_gpu=4, bf16={"enabled": True})
    cfg = parse_config(given, dp_world_size=2)
    assert cfg is not given
    assert cfg.batch == (8, 4, 1)
    assert cfg.bf16.enabled
    assert given.train_batch_size is None


def test_nonexistent_path_error() -> None:
    """A path that does not exist says so; a string that is neither lists the input forms."""
    _error(
        "/no/such/dir/ds_config.json", "config file '/no/such/dir/ds_config.json' does not exist"
    )
    _error(
        "not a config",
        "config 'not a config' is not an existing file and not base64-encoded JSON",
        "pass a dict, a path to a JSON/HJSON file, or a SlipstreamConfig",
    )


def test_unparseable_file_error(tmp_path: Path) -> None:
    """A file that is neither JSON nor HJSON names the file."""
    path = tmp_path / "broken.json"
    path.write_text('{"train_batch_size": 8,\n  "fp16": {"enabled": true\n')
    _error(str(path), f"config file '{path}' is neither valid JSON nor HJSON")


@pytest.mark.parametrize(
    "text, key",
    [
        ('{"train_batch_size": 8, "train_batch_size": 16}', "train_batch_size"),
        ('{"train_batch_size": 8, "zero_optimization": {"stage": 1, "stage": 2}}', "stage"),
    ],
    ids=["top-level", "nested"],
)
def test_duplicate_keys_in_json_file_rejected(tmp_path: Path, text: str, key: str) -> None:
    """Duplicate keys in a JSON file are an error naming the key (DeepSpeed rejects them too)."""
    path = tmp_path / "dup.json"
    path.write_text(text)
    _error(str(path), f"duplicate key '{key}' in config file")


def test_duplicate_keys_in_hjson_file_rejected(tmp_path: Path) -> None:
    """Duplicate keys are also caught on the HJSON path."""
    path = tmp_path / "dup.hjson"
    path.write_text("{\n  # comment\n  train_batch_size: 8\n  train_batch_size: 16\n}\n")
    _error(str(path), "duplicate key 'train_batch_size' in config file")


def test_duplicate_keys_in_base64_rejected_naming_key() -> None:
    """A base64 config with a duplicate key reports the duplicate, not a decoding failure."""
    encoded = base64.b64encode(b'{"train_batch_size": 8, "train_batch_size": 16}').decode()
    _error(encoded, "duplicate key 'train_batch_size'")


def test_non_object_top_level_is_config_error(tmp_path: Path) -> None:
    """A config file holding a JSON array is a ConfigError, not an AttributeError."""
    path = tmp_path / "list.json"
    path.write_text('[{"train_batch_size": 8}]')
    with pytest.raises(ConfigError):
        parse_config(str(path))


# --- unknown keys ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config, path, hint",
    [
        ({"zero_optimisation": {"stage": 1}}, "zero_optimisation", "zero_optimization"),
        (
            {"gradient_accumulation_step": 2},
            "gradient_accumulation_step",
            "gradient_accumulation_steps",
        ),
        ({"zero_optimization": {"stagee": 2}}, "zero_optimization.stagee", "stage"),
        (
            {"zero_optimization": {"reduce_bucket_sise": 10}},
            "zero_optimization.reduce_bucket_sise",
            "reduce_bucket_size",
        ),
        ({"fp16": {"initial_scale_pwr": 16}}, "fp16.initial_scale_pwr", "initial_scale_power"),
        ({"bf16": {"enable": True}}, "bf16.enable", "enabled"),
        (
            {"zero_optimization": {"offload_optimizer": {"devcie": "none"}}},
            "zero_optimization.offload_optimizer.devcie",
            "device",
        ),
        ({"comms_logger": {"verbos": True}}, "comms_logger.verbos", "verbose"),
        ({"optimizer": {"type": "AdamW", "param": {}}}, "optimizer.param", "params"),
        (
            {"data_types": {"grad_accum_dtyp": "fp32"}},
            "data_types.grad_accum_dtyp",
            "grad_accum_dtype",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_unknown_key_names_dotted_path_and_suggestion(
    config: dict[str, Any], path: str, hint: str
) -> None:
    """A misspelled key (top level or nested) is an error with its dotted path and a did-you-mean."""
    msg = _error(_cfg(**config), f"unknown config key '{path}'", f"did you mean '{hint}'?")
    assert "slipstream rejects keys it would otherwise ignore" in msg


def test_unknown_key_without_close_match_lists_valid_keys() -> None:
    """With no close match the message lists the keys valid at that level."""
    _error(
        _cfg(xyzzy_plugh=1),
        "unknown config key 'xyzzy_plugh'",
        "valid keys here are: activation_checkpointing, aio, autotuning, bf16,",
    )
    _error(
        _cfg(fp16={"qwerty": 1}),
        "unknown config key 'fp16.qwerty'",
        "valid keys here are: auto_cast, consecutive_hysteresis, enabled,",
    )


# --- deprecated aliases ----------------------------------------------------------------------


def test_alias_bfloat16() -> None:
    """``bfloat16`` is renamed to ``bf16`` with a DeprecationWarning."""
    with pytest.warns(DeprecationWarning, match="config key 'bfloat16' is deprecated; use 'bf16'"):
        cfg = parse_config(_cfg(bfloat16={"enabled": True}))
    assert cfg.bf16.enabled


def test_alias_bfloat16_loses_to_bf16() -> None:
    """With both names present ``bf16`` wins, as in DeepSpeed."""
    with pytest.warns(DeprecationWarning):
        cfg = parse_config(_cfg(bfloat16={"enabled": True}, bf16={"enabled": False}))
    assert not cfg.bf16.enabled


@pytest.mark.parametrize("flag, stage", [(True, 1), (False, 0)])
def test_alias_zero_optimization_bool(flag: bool, stage: int) -> None:
    """``zero_optimization: true/false`` means stage 1/0, with a DeprecationWarning."""
    with pytest.warns(DeprecationWarning, match="'zero_optimization': true/false is deprecated"):
        cfg = parse_config(_cfg(zero_optimization=flag))
    assert cfg.zero_optimization.stage == stage


def test_alias_cpu_offload_becomes_offload_optimizer() -> None:
    """``cpu_offload: true`` becomes ``offload_optimizer: {device: cpu}`` (warned)."""
    with pytest.warns(
        DeprecationWarning,
        match="'zero_optimization.cpu_offload' is deprecated; use 'zero_optimization.offload_optimizer'",
    ):
        cfg = parse_config(_cfg(zero_optimization={"stage": 2, "cpu_offload": True}))
    assert cfg.zero_optimization.offload_optimizer is not None
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"


def test_alias_cpu_offload_false_is_dropped() -> None:
    """``cpu_offload: false`` is warned about and leaves offload off."""
    with pytest.warns(DeprecationWarning, match="cpu_offload"):
        cfg = parse_config(_cfg(zero_optimization={"stage": 2, "cpu_offload": False}))
    assert cfg.zero_optimization.offload_optimizer is None


def test_alias_cpu_offload_param_then_needs_stage_3() -> None:
    """``cpu_offload_param: true`` becomes ``offload_param`` (warned), which needs stage 3;
    NVMe parameter offload is refused."""
    with (
        pytest.warns(DeprecationWarning, match="use 'zero_optimization.offload_param'"),
        pytest.raises(ConfigError, match=r"offload_param needs stage 3.*stage = 2"),
    ):
        parse_config(_cfg(zero_optimization={"stage": 2, "cpu_offload_param": True}))
    zero = {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/tmp"}}
    with pytest.raises(ConfigError, match=r"offload_param\.device = 'nvme' is not implemented"):
        parse_config(_cfg(zero_optimization=zero))
    cfg = parse_config(_cfg(zero_optimization={"stage": 3, "offload_param": {"device": "cpu"}}))
    assert cfg.zero_optimization.offload_param is not None


def test_alias_stage3_gather_fp16_weights() -> None:
    """The fp16-named gather flag is renamed to the 16-bit name with a DeprecationWarning."""
    old = "zero_optimization.stage3_gather_fp16_weights_on_model_save"
    new = "zero_optimization.stage3_gather_16bit_weights_on_model_save"
    with pytest.warns(DeprecationWarning, match=f"'{old}' is deprecated; use '{new}'"):
        cfg = parse_config(
            _cfg(zero_optimization={"stage3_gather_fp16_weights_on_model_save": True})
        )
    assert cfg.zero_optimization.stage3_gather_16bit_weights_on_model_save


def test_alias_warning_points_at_caller() -> None:
    """The DeprecationWarning is attributed to the code calling parse_config, not the loader."""
    with pytest.warns(DeprecationWarning) as record:
        parse_config(_cfg(bfloat16={"enabled": True}))
    with pytest.warns(DeprecationWarning) as record_bool:
        parse_config(_cfg(zero_optimization=True))
    assert [r.filename for r in (*record, *record_bool)] == [__file__, __file__]


# --- typed values ----------------------------------------------------------------------------


def test_short_stage3_alias_error_names_canonical_key() -> None:
    """The short stage-3 names are renamed first, so errors name the stage3_ key."""
    _error(
        _cfg(**_nested("zero_optimization.prefetch_bucket_size", -1)),
        "config key 'zero_optimization.stage3_prefetch_bucket_size' = -1",
    )


@pytest.mark.parametrize(
    "dotted, value, constraint",
    [
        ("gradient_clipping", -1.0, "greater than or equal to 0"),
        ("steps_per_print", 0, "greater than or equal to 1"),
        ("gradient_predivide_factor", 0.0, "greater than 0"),
        ("zero_optimization.reduce_bucket_size", 0, "greater than or equal to 1"),
        ("zero_optimization.allgather_bucket_size", -5, "greater than or equal to 1"),
        ("zero_optimization.sub_group_size", 0, "greater than or equal to 1"),
        ("zero_optimization.stage3_prefetch_bucket_size", -1, "greater than or equal to 0"),
        ("zero_optimization.stage", -1, "greater than or equal to 0"),
        ("zero_optimization.offload_optimizer.buffer_count", 0, "greater than or equal to 1"),
        ("zero_optimization.offload_optimizer.ratio", 1.5, "less than or equal to 1"),
        ("fp16.loss_scale", -1.0, "greater than or equal to 0"),
        ("fp16.loss_scale_window", 0, "greater than or equal to 1"),
        ("fp16.hysteresis", 0, "greater than or equal to 1"),
        ("fp16.min_loss_scale", 0.0, "greater than 0"),
        ("fp16.initial_scale_power", 65, "less than or equal to 64"),
    ],
)
def test_out_of_range_value_names_path(dotted: str, value: Any, constraint: str) -> None:
    """A negative, zero or too-large value is an error with the dotted key, value and bound."""
    _error(
        _cfg(**_nested(dotted, value)),
        f"config key '{dotted}' = {value!r}: Input should be {constraint}",
    )


@pytest.mark.parametrize(
    "dotted, value, fragment",
    [
        ("fp16", True, "expected an object ({...}), got a boolean"),
        ("bf16.enabled", "maybe", "expected true or false, got a string"),
        ("communication_data_type", "fp64", "'fp32', 'fp16' or 'bf16'"),
        ("data_types.grad_accum_dtype", "fp64", "'fp32', 'fp16' or 'bf16'"),
        ("zero_optimization.offload_optimizer.device", "gpu", "'none', 'cpu' or 'nvme'"),
        ("zero_optimization.reduce_bucket_size", 1.5, "fractional part"),
        ("optimizer", {"params": {"lr": 1e-3}}, "optimizer.type"),
    ],
)
def test_wrong_type_names_path(dotted: str, value: Any, fragment: str) -> None:
    """A value of the wrong type or outside a choice names the key and the accepted values."""
    _error(_cfg(**_nested(dotted, value)), f"config key '{dotted}", fragment)


def test_integral_float_bucket_sizes_accepted() -> None:
    """DeepSpeed configs write bucket sizes as ``5e8``; they become ints."""
    cfg = parse_config(
        _cfg(zero_optimization={"reduce_bucket_size": 5e8, "allgather_bucket_size": 2e8})
    )
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000
    assert cfg.zero_optimization.allgather_bucket_size == 200_000_000


@pytest.mark.parametrize(
    "long_name, short_name, value",
    [
        ("stage3_prefetch_bucket_size", "prefetch_bucket_size", 1234),
        ("stage3_param_persistence_threshold", "param_persistence_threshold", 10),
        ("stage3_model_persistence_threshold", "model_persistence_threshold", 99),
        ("stage3_max_live_parameters", "max_live_parameters", 7),
        ("stage3_max_reuse_distance", "max_reuse_distance", 8),
        ("stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save", True),
        ("stage3_module_granularity_threshold", "module_granularity_threshold", 5),
        ("stage3_use_all_reduce_for_fetch_params", "use_all_reduce_for_fetch_params", True),
        ("stage3_allgather_sequential", "allgather_sequential", True),
    ],
)
def test_stage3_long_and_short_names(long_name: str, short_name: str, value: Any) -> None:
    """Every stage3_* key is accepted under its DeepSpeed name and its short field alias."""
    for name in (long_name, short_name):
        cfg = parse_config(_cfg(zero_optimization={name: value}))
        assert getattr(cfg.zero_optimization, long_name) == value


@pytest.mark.parametrize("overlap_comm, expected", [(None, True), (True, True), (False, False)])
def test_overlap_property(overlap_comm: bool | None, expected: bool) -> None:
    """``overlap`` defaults to true when overlap_comm is unset, else follows it."""
    zero = {} if overlap_comm is None else {"overlap_comm": overlap_comm}
    cfg = parse_config(_cfg(zero_optimization={"stage": 1, **zero}))
    assert cfg.zero_optimization.overlap_comm is overlap_comm
    assert cfg.zero_optimization.overlap is expected


# --- example configs and round trips ---------------------------------------------------------


def test_example_zero1_fp16() -> None:
    """The ZeRO-1 fp16 example: dynamic loss scaling, a disabled tensorboard block kept."""
    cfg = parse_config(EXAMPLES / "zero1_fp16.json", dp_world_size=4)
    assert cfg.batch == (32, 4, 2)
    assert cfg.fp16.enabled and cfg.fp16.loss_scale == 0.0 and cfg.fp16.initial_scale_power == 16
    assert cfg.zero_optimization.stage == 1
    assert cfg.optimizer is not None and cfg.optimizer.type == "Adam"
    assert cfg.scheduler is not None and cfg.scheduler.params["warmup_num_steps"] == 500
    assert not cfg.tensorboard.enabled and cfg.tensorboard.job_name == "zero1_fp16"


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_example_zero2_bf16_gas_follows_world_size(dp: int) -> None:
    """train_batch_size 64 with micro 8 gives gas 8/dp, as DeepSpeed infers it."""
    cfg = parse_config(EXAMPLES / "zero2_bf16.json", dp_world_size=dp)
    assert cfg.batch == (64, 8, 8 // dp)
    assert cfg.zero_optimization.overlap and cfg.gradient_clipping == 1.0


def test_example_auto_hf_style() -> None:
    """The HF-style example resolves every "auto" from the model, optimizer and world size."""
    ctx = _full_auto(hidden_size=768)
    cfg = parse_config(EXAMPLES / "auto_hf_style.json", dp_world_size=2, auto=ctx)
    assert cfg.batch == (16, 4, 2)
    assert cfg.bf16.enabled and not cfg.fp16.enabled
    assert cfg.optimizer is not None
    assert cfg.optimizer.params == {
        "lr": 1e-3,
        "betas": (0.9, 0.999),
        "eps": 1e-8,
        "weight_decay": 0.0,
    }
    assert cfg.scheduler is not None
    assert cfg.scheduler.params == {
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 1e-3,
        "warmup_num_steps": 100,
    }
    assert cfg.zero_optimization.reduce_bucket_size == 768 * 768
    assert set(ctx.resolved) == {
        "fp16.enabled",
        "bf16.enabled",
        "optimizer.params.lr",
        "optimizer.params.betas",
        "optimizer.params.eps",
        "optimizer.params.weight_decay",
        "scheduler.params.warmup_min_lr",
        "scheduler.params.warmup_max_lr",
        "zero_optimization.reduce_bucket_size",
        "zero_optimization.allgather_bucket_size",
    }


def test_example_auto_hf_style_with_gradient_clipping_auto_rejected() -> None:
    """HF Trainer's ``gradient_clipping: "auto"`` has no source here and is rejected by name."""
    raw = load_config(EXAMPLES / "auto_hf_style.json")
    raw["gradient_clipping"] = "auto"
    _error(raw, "cannot resolve config key 'gradient_clipping' = \"auto\"", auto=_full_auto())


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.*json")), ids=lambda p: p.name)
def test_every_example_parses(path: Path) -> None:
    """Every shipped example config parses for dp 1, 2 and 4."""
    for dp in (1, 2, 4):
        cfg = parse_config(path, dp_world_size=dp, auto=_full_auto())
        assert cfg.zero_optimization.stage in (1, 2)


@pytest.mark.parametrize("name", ["zero2_bf16.json", "zero1_fp16.json", "auto_hf_style.json"])
def test_model_dump_round_trip(name: str) -> None:
    """A parsed config re-parses to itself as an object, a dict dump and a JSON dump."""
    cfg = parse_config(EXAMPLES / name, dp_world_size=2, auto=_full_auto())
    again = [
        parse_config(cfg, dp_world_size=2),
        parse_config(cfg.model_dump(), dp_world_size=2),
        parse_config(json.loads(cfg.model_dump_json()), dp_world_size=2),
    ]
    for other in again:
        assert other.model_dump(mode="json") == cfg.model_dump(mode="json")


def test_stage3_knobs_not_honoured_yet_are_rejected_when_changed() -> None:
    """Stage-3 knobs slipstream does not implement are errors unless left at their defaults."""
    assert (
        parse_config(
            _cfg(zero_optimization={"stage": 3, "stage3_max_reuse_distance": 1e9})
        ).zero_optimization.stage
        == 3
    )
    _error(
        _cfg(zero_optimization={"stage": 3, "stage3_max_reuse_distance": 0}),
        "zero_optimization.stage3_max_reuse_distance = 0 is not honoured yet",
        "remove it or use the default",
    )
