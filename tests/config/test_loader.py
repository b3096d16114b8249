"""Tests for the DeepSpeed config loader: input forms, aliases, "auto", the batch triple, errors."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from slipstream.config import (
    AutoContext,
    ConfigError,
    SlipstreamConfig,
    load_config,
    parse_config,
    resolve_batch_sizes,
)
from slipstream.config.schema import NOT_YET_IMPLEMENTED
from slipstream.optim import optimizer_defaults

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "configs"
MB = {"train_micro_batch_size_per_gpu": 2}
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _cfg(**blocks: Any) -> dict[str, Any]:
    """A minimal valid config (micro batch 2) plus ``blocks``."""
    return {**MB, **blocks}


def _nested(dotted: str, value: Any) -> dict[str, Any]:
    """``"a.b.c", v`` -> ``{"a": {"b": {"c": v}}}``."""
    out: Any = value
    for part in reversed(dotted.split(".")):
        out = {part: out}
    return out


def _full_auto(**kwargs: Any) -> AutoContext:
    """An AutoContext that can resolve everything slipstream resolves."""
    base: dict[str, Any] = {
        "hidden_size": 64,
        "model_dtype": torch.bfloat16,
        "optimizer_defaults": optimizer_defaults,
    }
    return AutoContext(**{**base, **kwargs})


def _error(config: Any, *fragments: str, **kwargs: Any) -> str:
    """Parse ``config`` expecting a ConfigError whose message contains every fragment."""
    with pytest.raises(ConfigError) as info:
        parse_config(config, **kwargs)
    msg = str(info.value)
    for fragment in fragments:
        assert fragment in msg, f"{fragment!r} not in {msg!r}"
    return msg


def _b64(config: dict[str, Any]) -> str:
    return base64.b64encode(json.dumps(config).encode()).decode()


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
        "valid keys here are: activation_checkpointing, bf16,",
    )
    _error(
        _cfg(fp16={"qwerty": 1}),
        "unknown config key 'fp16.qwerty'",
        "valid keys here are: auto_cast, consecutive_hysteresis, enabled,",
    )


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


def test_batch_integral_float_accepted() -> None:
    """An integral float (JSON ``64.0`` or ``6.4e1``) is accepted as an int."""
    cfg = parse_config({"train_batch_size": 6.4e1, "train_micro_batch_size_per_gpu": 8.0})
    assert cfg.batch == (64, 8, 8)
    assert all(isinstance(v, int) for v in cfg.batch)


def test_resolve_batch_sizes_function() -> None:
    """The public helper returns (train_batch_size, micro, gas)."""
    assert resolve_batch_sizes(None, 4, 2, dp_world_size=2) == (16, 4, 2)
    assert resolve_batch_sizes(64, None, None, dp_world_size=4) == (64, 16, 1)
    with pytest.raises(ConfigError, match="do not multiply out"):
        resolve_batch_sizes(10, 4, 2, dp_world_size=1)


# --- "auto" ----------------------------------------------------------------------------------

_HF_OPTIMIZER = {
    "type": "AdamW",
    "params": dict.fromkeys(("lr", "betas", "eps", "weight_decay"), "auto"),
}


def test_optimizer_auto_from_defaults() -> None:
    """Optimizer "auto" params take the defaults slipstream's builder would use; ctx records them."""
    ctx = AutoContext(optimizer_defaults=optimizer_defaults)
    cfg = parse_config(_cfg(optimizer=_HF_OPTIMIZER), auto=ctx)
    defaults = optimizer_defaults("AdamW")
    expected = {k: defaults[k] for k in ("lr", "betas", "eps", "weight_decay")}
    assert cfg.optimizer is not None and cfg.optimizer.params == expected
    assert expected == {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    assert ctx.resolved == {f"optimizer.params.{k}": v for k, v in expected.items()}


def test_optimizer_auto_client_hparams_win() -> None:
    """A client optimizer's hyperparameters win over the defaults for "auto" params."""
    ctx = AutoContext(
        optimizer_defaults=optimizer_defaults, client_hparams={"lr": 5e-5, "weight_decay": 0.1}
    )
    cfg = parse_config(_cfg(optimizer=_HF_OPTIMIZER), auto=ctx)
    assert cfg.optimizer is not None
    assert cfg.optimizer.params == {
        "lr": 5e-5,
        "betas": (0.9, 0.999),
        "eps": 1e-8,
        "weight_decay": 0.1,
    }
    assert ctx.resolved["optimizer.params.lr"] == 5e-5


def test_optimizer_explicit_value_not_overridden_by_client() -> None:
    """Only "auto" values are replaced: an explicit lr stays even if the client differs."""
    ctx = AutoContext(client_hparams={"lr": 5e-5, "eps": 1e-6})
    opt = {"type": "AdamW", "params": {"lr": 1e-4, "eps": "auto"}}
    cfg = parse_config(_cfg(optimizer=opt), auto=ctx)
    assert cfg.optimizer is not None and cfg.optimizer.params == {"lr": 1e-4, "eps": 1e-6}
    assert ctx.resolved == {"optimizer.params.eps": 1e-6}


def test_optimizer_auto_lion_uses_deepspeed_defaults() -> None:
    """Lion's "auto" lr/betas are DeepSpeed's FusedLion defaults, not the paper's."""
    opt = {"type": "Lion", "params": {"lr": "auto", "betas": "auto"}}
    cfg = parse_config(_cfg(optimizer=opt), auto=AutoContext(optimizer_defaults=optimizer_defaults))
    assert cfg.optimizer is not None and cfg.optimizer.params == {"lr": 1e-3, "betas": (0.9, 0.999)}


def test_optimizer_auto_respects_torch_adam() -> None:
    """'auto' resolves to what build_optimizer would use for the same params (torch_adam)."""
    opt = {"type": "Adam", "params": {"torch_adam": True, "weight_decay": "auto"}}
    cfg = parse_config(_cfg(optimizer=opt), auto=AutoContext(optimizer_defaults=optimizer_defaults))
    expected = optimizer_defaults("Adam", {"torch_adam": True})["weight_decay"]
    assert cfg.optimizer is not None and cfg.optimizer.params["weight_decay"] == expected


def test_optimizer_auto_without_default_is_error() -> None:
    """An "auto" param the optimizer has no default for names the key and the optimizer."""
    opt = {"type": "AdamW", "params": {"lr": 1e-3, "momentum": "auto"}}
    _error(
        _cfg(optimizer=opt),
        "cannot resolve 'optimizer.params.momentum' = \"auto\"",
        "optimizer 'AdamW'",
        "set a value",
        auto=AutoContext(optimizer_defaults=optimizer_defaults),
    )


def test_optimizer_auto_without_context_is_error() -> None:
    """With no AutoContext, optimizer "auto" is rejected naming the key."""
    _error(_cfg(optimizer=_HF_OPTIMIZER), "cannot resolve 'optimizer.params.lr' = \"auto\"")


def test_zero_bucket_sizes_auto_from_hidden_size() -> None:
    """Bucket sizes follow HF's rules: hidden^2, 0.9*hidden^2 and 10*hidden."""
    keys = (
        "reduce_bucket_size",
        "allgather_bucket_size",
        "stage3_prefetch_bucket_size",
        "stage3_param_persistence_threshold",
    )
    ctx = AutoContext(hidden_size=4096)
    cfg = parse_config(
        _cfg(zero_optimization={"stage": 2, **dict.fromkeys(keys, "auto")}), auto=ctx
    )
    zero = cfg.zero_optimization
    assert zero.reduce_bucket_size == 4096 * 4096
    assert zero.allgather_bucket_size == 4096 * 4096
    assert zero.stage3_prefetch_bucket_size == int(0.9 * 4096 * 4096) == 15_099_494
    assert zero.stage3_param_persistence_threshold == 10 * 4096
    assert ctx.resolved == {
        "zero_optimization.reduce_bucket_size": 16_777_216,
        "zero_optimization.allgather_bucket_size": 16_777_216,
        "zero_optimization.stage3_prefetch_bucket_size": 15_099_494,
        "zero_optimization.stage3_param_persistence_threshold": 40_960,
    }


@pytest.mark.parametrize(
    "key",
    [
        "reduce_bucket_size",
        "allgather_bucket_size",
        "stage3_prefetch_bucket_size",
        "stage3_param_persistence_threshold",
    ],
)
def test_zero_bucket_auto_without_hidden_size_is_error(key: str) -> None:
    """Without a hidden size the bucket "auto" is an error naming the key and what is missing."""
    _error(
        _cfg(zero_optimization={key: "auto"}),
        f"cannot resolve 'zero_optimization.{key}' = \"auto\"",
        "config.hidden_size",
        "set a number of elements instead",
        auto=AutoContext(model_dtype=torch.float32),
    )


def test_zero_short_alias_bucket_auto_resolved() -> None:
    """``prefetch_bucket_size: "auto"`` resolves like ``stage3_prefetch_bucket_size``."""
    cfg = parse_config(
        _cfg(zero_optimization={"prefetch_bucket_size": "auto"}), auto=AutoContext(hidden_size=100)
    )
    assert cfg.zero_optimization.stage3_prefetch_bucket_size == 9000


@pytest.mark.parametrize(
    "dtype, fp16, bf16",
    [(torch.float16, True, False), (torch.bfloat16, False, True), (torch.float32, False, False)],
    ids=["fp16-model", "bf16-model", "fp32-model"],
)
def test_precision_enabled_auto_from_model_dtype(
    dtype: torch.dtype, fp16: bool, bf16: bool
) -> None:
    """``fp16/bf16.enabled: "auto"`` follows the model's parameter dtype."""
    ctx = AutoContext(model_dtype=dtype)
    cfg = parse_config(_cfg(fp16={"enabled": "auto"}, bf16={"enabled": "auto"}), auto=ctx)
    assert (cfg.fp16.enabled, cfg.bf16.enabled) == (fp16, bf16)
    assert ctx.resolved == {"fp16.enabled": fp16, "bf16.enabled": bf16}


def test_precision_auto_without_model_is_error() -> None:
    """``enabled: "auto"`` with no model dtype names the key."""
    _error(
        _cfg(bf16={"enabled": "auto"}), "cannot resolve 'bf16.enabled' = \"auto\" without a model"
    )


def test_scheduler_lr_auto_from_optimizer_lr() -> None:
    """warmup_max_lr "auto" takes optimizer.params.lr; warmup_min_lr "auto" is 0."""
    ctx = AutoContext()
    sched = {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto"}}
    opt = {"type": "AdamW", "params": {"lr": 3e-4}}
    cfg = parse_config(_cfg(optimizer=opt, scheduler=sched), auto=ctx)
    assert cfg.scheduler is not None
    assert cfg.scheduler.params == {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-4}
    assert ctx.resolved == {
        "scheduler.params.warmup_min_lr": 0.0,
        "scheduler.params.warmup_max_lr": 3e-4,
    }


def test_scheduler_lr_auto_follows_resolved_optimizer_lr() -> None:
    """An optimizer lr that is itself "auto" is resolved first, then feeds the scheduler."""
    sched = {"type": "WarmupLR", "params": {"warmup_max_lr": "auto", "warmup_num_steps": 10}}
    cfg = parse_config(
        _cfg(optimizer=_HF_OPTIMIZER, scheduler=sched),
        auto=AutoContext(optimizer_defaults=optimizer_defaults),
    )
    assert cfg.scheduler is not None and cfg.scheduler.params["warmup_max_lr"] == 1e-3


def test_scheduler_lr_auto_client_lr_wins() -> None:
    """With a client optimizer its lr drives the scheduler's "auto" bounds (OneCycle too)."""
    sched = {"type": "OneCycle", "params": {"cycle_max_lr": "auto", "cycle_min_lr": 1e-5}}
    opt = {"type": "AdamW", "params": {"lr": 3e-4}}
    ctx = AutoContext(client_hparams={"lr": 2e-5})
    cfg = parse_config(_cfg(optimizer=opt, scheduler=sched), auto=ctx)
    assert cfg.scheduler is not None and cfg.scheduler.params["cycle_max_lr"] == 2e-5


def test_scheduler_lr_auto_without_any_lr_is_error() -> None:
    """warmup_max_lr "auto" with no optimizer lr anywhere is rejected naming the key."""
    sched = {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}
    _error(
        _cfg(scheduler=sched),
        "cannot resolve config key 'scheduler.params.warmup_max_lr' = \"auto\"",
    )


@pytest.mark.parametrize(
    "dotted",
    [
        "gradient_clipping",
        "steps_per_print",
        "scheduler.params.warmup_num_steps",
        "scheduler.params.total_num_steps",
        "fp16.loss_scale",
        "zero_optimization.stage",
        "zero_optimization.overlap_comm",
        "optimizer.type",
    ],
)
def test_unresolvable_auto_is_error(dotted: str) -> None:
    """An "auto" slipstream cannot resolve names the key and lists what it does resolve."""
    config = _cfg(**_nested(dotted, "auto"))
    if dotted.startswith("scheduler."):
        config["scheduler"]["type"] = "WarmupDecayLR"
    _error(
        config,
        f"cannot resolve config key '{dotted}' = \"auto\"",
        "slipstream resolves 'auto' only for batch sizes, optimizer hyperparameters",
        "set an explicit value",
        auto=_full_auto(),
    )


def test_auto_is_case_insensitive() -> None:
    """Spellings "AUTO" and "Auto" count as "auto" (resolved or rejected alike)."""
    ctx = AutoContext(model_dtype=torch.bfloat16)
    cfg = parse_config(
        {
            "train_batch_size": "AUTO",
            "train_micro_batch_size_per_gpu": 2,
            "bf16": {"enabled": "Auto"},
        },
        auto=ctx,
    )
    assert cfg.bf16.enabled and cfg.batch == (2, 2, 1)
    _error(_cfg(gradient_clipping="AUTO"), "cannot resolve config key 'gradient_clipping'")


def test_resolved_is_empty_without_auto() -> None:
    """Nothing is recorded in ``ctx.resolved`` when the config has no "auto"."""
    ctx = _full_auto()
    parse_config(EXAMPLES / "zero2_bf16.json", dp_world_size=2, auto=ctx)
    assert ctx.resolved == {}


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


# --- cross-field rules and features of later issues ------------------------------------------


def test_fp16_and_bf16_both_enabled_rejected() -> None:
    """fp16 and bf16 together are an error naming both keys."""
    _error(
        _cfg(fp16={"enabled": True}, bf16={"enabled": True}),
        "fp16.enabled and bf16.enabled are both true: choose one precision",
    )


def test_stage_3_accepted() -> None:
    """ZeRO stage 3 parses (offload, which also arrives with issue 3, is still refused)."""
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
        ("memory_breakdown", True, "memory_breakdown is not implemented yet"),
        ("amp", {"enabled": True, "opt_level": "O1"}, "use bf16 or fp16"),
    ],
)
def test_not_yet_implemented_scalar_values_rejected(key: str, value: Any, fragment: str) -> None:
    """Non-trivial values of unimplemented keys name the key, the value and why."""
    _error(_cfg(**{key: value}), f"config key '{key}' = {value!r} cannot be honoured", fragment)


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
        ("fp16", True, "valid dictionary"),
        ("bf16.enabled", "maybe", "valid boolean"),
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
    """The ZeRO-1 fp16 example: dynamic loss scaling, disabled tensorboard dropped."""
    cfg = parse_config(EXAMPLES / "zero1_fp16.json", dp_world_size=4)
    assert cfg.batch == (32, 4, 2)
    assert cfg.fp16.enabled and cfg.fp16.loss_scale == 0.0 and cfg.fp16.initial_scale_power == 16
    assert cfg.zero_optimization.stage == 1
    assert cfg.optimizer is not None and cfg.optimizer.type == "Adam"
    assert cfg.scheduler is not None and cfg.scheduler.params["warmup_num_steps"] == 500
    assert "tensorboard" not in cfg.model_dump()


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
        "issue 3",
    )
