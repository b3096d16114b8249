"""``"auto"`` config values (the Hugging Face integration writes them): each is resolved from
the model and the optimizer, or refused naming the key."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from slipstream.config._base import StrictModel
from slipstream.config._errors import ConfigError
from slipstream.config.zero import OffloadConfig, ZeroConfig

__all__ = ["AUTO", "BATCH_KEYS", "AutoContext", "is_auto", "reject_remaining_auto", "resolve_auto"]

AUTO = "auto"

# "auto" batch sizes are left to the batch arithmetic (``loader.resolve_batch_sizes``).
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


@dataclass
class AutoContext:
    """What ``"auto"`` values are resolved from.

    Attributes:
        hidden_size: the model's hidden size (``model.config.hidden_size``), for bucket sizes.
        model_dtype: dtype of the model's floating-point parameters, for ``fp16/bf16.enabled``.
        optimizer_defaults: maps an optimizer type name and its explicit params to the
            hyperparameters it would use by default.
        client_hparams: hyperparameters of a client optimizer's first param group, if any.
    """

    hidden_size: int | None = None
    model_dtype: Any = None
    optimizer_defaults: Callable[[str, dict[str, Any]], dict[str, Any]] | None = None
    client_hparams: dict[str, Any] = field(default_factory=dict)
    resolved: dict[str, Any] = field(default_factory=dict)
    defaulted: list[str] = field(default_factory=list)
    """Keys whose "auto" took DeepSpeed's default (nothing to resolve them from)."""


def is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.lower() == AUTO


def resolve_auto(raw: dict[str, Any], ctx: AutoContext) -> None:
    """Replace every ``"auto"`` in ``raw`` or raise naming the key."""
    _resolve_precision_auto(raw, ctx)
    _resolve_optimizer_auto(raw, ctx)
    _resolve_scheduler_auto(raw, ctx)
    # Mesh sizes: "auto" means "whatever the world and the other sizes leave".
    if is_auto(raw.get("data_parallel_size")):
        raw["data_parallel_size"] = None
    pipe = raw.get("pipeline")
    for key in ("stages", "num_stages"):
        if isinstance(pipe, dict) and is_auto(pipe.get(key)):
            pipe[key] = None
    zero = raw.get("zero_optimization")
    if isinstance(zero, dict):
        _resolve_zero_auto(zero, ctx)
    tiled = raw.get("tiled_compute")
    for key in ("mlp_shards", "logits_loss_shards"):  # "auto": chosen per sequence length
        if isinstance(tiled, dict) and is_auto(tiled.get(key)):
            tiled[key] = None
    reject_remaining_auto(raw, "")


# Hugging Face's rules for "auto" ZeRO sizes from the model's hidden size h: factor x h^2,
# or 10 x h where the factor is None.
_HIDDEN_RULES = {
    "reduce_bucket_size": 1.0,
    "allgather_bucket_size": 1.0,
    "stage3_prefetch_bucket_size": 0.9,
    "stage3_param_persistence_threshold": None,
}


def _resolve_zero_auto(zero: dict[str, Any], ctx: AutoContext) -> None:
    """Sizes from the hidden size where the model has one; every other "auto" in the block
    takes DeepSpeed's default, as DeepSpeed's own config models drop "auto" values."""
    h = ctx.hidden_size
    for key, factor in _HIDDEN_RULES.items():
        if is_auto(zero.get(key)) and h is not None:
            zero[key] = 10 * h if factor is None else int(factor * h * h)
            ctx.resolved[f"zero_optimization.{key}"] = zero[key]
    _drop_auto(zero, ZeroConfig, "zero_optimization", ctx)
    for key in ("offload_optimizer", "offload_param"):
        if isinstance(zero.get(key), dict):
            _drop_auto(zero[key], OffloadConfig, f"zero_optimization.{key}", ctx)


def _drop_auto(
    block: dict[str, Any], model: type[StrictModel], where: str, ctx: AutoContext
) -> None:
    """Drop the "auto" values of ``model``'s fields (unknown keys stay, to be refused, and
    so does ``stage``: DeepSpeed would silently run stage 0)."""
    fields = model.model_fields
    known = (set(fields) | {f.alias for f in fields.values() if f.alias}) - {"stage"}
    for key in [k for k, v in block.items() if is_auto(v) and k in known]:
        del block[key]
        ctx.defaulted.append(f"{where}.{key}")


def _resolve_precision_auto(raw: dict[str, Any], ctx: AutoContext) -> None:
    import torch

    for key, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        block = raw.get(key)
        if isinstance(block, dict) and is_auto(block.get("enabled")):
            if ctx.model_dtype is None:
                raise ConfigError(f"cannot resolve '{key}.enabled' = \"auto\" without a model")
            block["enabled"] = ctx.model_dtype == dtype
            ctx.resolved[f"{key}.enabled"] = block["enabled"]


def _resolve_optimizer_auto(raw: dict[str, Any], ctx: AutoContext) -> None:
    opt = raw.get("optimizer")
    if not isinstance(opt, dict) or not isinstance(opt.get("params"), dict):
        return
    params = opt["params"]
    autos = [k for k, v in params.items() if is_auto(v)]
    if not autos:
        return
    fixed = {k: v for k, v in params.items() if not is_auto(v)}
    defaults = (
        ctx.optimizer_defaults(str(opt.get("type", "")), fixed) if ctx.optimizer_defaults else {}
    )
    for key in autos:
        if key in ctx.client_hparams:
            params[key] = ctx.client_hparams[key]
        elif key in defaults:
            params[key] = defaults[key]
        else:
            raise ConfigError(
                f"cannot resolve 'optimizer.params.{key}' = \"auto\": optimizer "
                f"'{opt.get('type')}' has no default for it; set a value"
            )
        ctx.resolved[f"optimizer.params.{key}"] = params[key]


def _resolve_scheduler_auto(raw: dict[str, Any], ctx: AutoContext) -> None:
    sched = raw.get("scheduler")
    if not isinstance(sched, dict) or not isinstance(sched.get("params"), dict):
        return
    params = sched["params"]
    opt = raw.get("optimizer")
    opt_lr = ctx.client_hparams.get("lr")
    if opt_lr is None and isinstance(opt, dict):
        opt_lr = (opt.get("params") or {}).get("lr")
    rules = {"warmup_max_lr": opt_lr, "warmup_min_lr": 0.0, "cycle_max_lr": opt_lr}
    for key, value in params.items():
        if is_auto(value) and rules.get(key) is not None:
            params[key] = rules[key]
            ctx.resolved[f"scheduler.params.{key}"] = params[key]


def reject_remaining_auto(node: Any, where: str) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            path = f"{where}.{key}" if where else key
            if path == "expert_parallel":  # "auto" is a value of its own there (AutoEP)
                continue
            if is_auto(value) and key not in BATCH_KEYS:
                raise ConfigError(
                    f"cannot resolve config key '{path}' = \"auto\": slipstream resolves 'auto' "
                    "only for batch sizes, optimizer hyperparameters, scheduler lr bounds, "
                    "fp16/bf16.enabled and zero_optimization keys; set an explicit value"
                )
            reject_remaining_auto(value, path)
