""" "auto" config values: resolved from the optimizer defaults, client hyper-parameters, the model, or a clear error."""

from __future__ import annotations

import logging

import pytest
import torch

from slipstream.config import (
    AutoContext,
    parse_config,
)
from slipstream.optim import optimizer_defaults
from tests.config._helpers import EXAMPLES, _cfg, _error, _full_auto, _nested

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
    "key, default",
    [
        ("reduce_bucket_size", 500_000_000),
        ("allgather_bucket_size", 500_000_000),
        ("stage3_prefetch_bucket_size", 50_000_000),
        ("stage3_param_persistence_threshold", 100_000),
        ("sub_group_size", 1_000_000_000),
    ],
)
def test_zero_auto_without_hidden_size_is_deepspeeds_default(
    key: str, default: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Without a hidden size a ZeRO "auto" takes DeepSpeed 0.19.8's default (its config
    models drop "auto"), and a log line names the key and the value."""
    ctx = AutoContext(model_dtype=torch.float32)
    with caplog.at_level(logging.INFO, logger="slipstream"):
        cfg = parse_config(_cfg(zero_optimization={key: "auto"}), auto=ctx)
    assert getattr(cfg.zero_optimization, key) == default
    assert ctx.defaulted == [f"zero_optimization.{key}"]
    assert f'zero_optimization.{key} = "auto": DeepSpeed\'s default {default}' in caplog.text


def test_unknown_zero_key_with_auto_is_still_refused() -> None:
    """Only keys ZeroConfig knows take a default: a misspelt one is an error naming it."""
    _error(
        _cfg(zero_optimization={"reduce_bucket_sise": "auto"}),
        "'zero_optimization.reduce_bucket_sise'",
        auto=AutoContext(model_dtype=torch.float32),
    )


def test_cuda_visible_devices_is_warned_and_dropped() -> None:
    """DeepSpeed never reads cuda_visible_devices (three DeepSpeedExamples configs carry it):
    a warning saying what to use instead, not an unknown-key error."""
    with pytest.warns(UserWarning, match="'cuda_visible_devices' = 0 is ignored.*--include"):
        cfg = parse_config(_cfg(cuda_visible_devices=0))
    assert "cuda_visible_devices" not in cfg.model_dump()


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


def test_accelerates_infinite_steps_per_print_means_never() -> None:
    """Accelerate writes steps_per_print = inf to silence DeepSpeed: no step lines."""
    assert parse_config(_cfg(steps_per_print=float("inf"))).steps_per_print is None


def test_config_reads_like_deepspeeds_dict() -> None:
    """engine.config.get(...) as on DeepSpeed's engine (the HF Trainer reads the stage so)."""
    cfg = parse_config(_cfg(zero_optimization={"stage": 3}))
    assert cfg.get("zero_optimization", {}).get("stage") == 3
    assert cfg.get("no_such_block", "x") == "x"
