"""DeepSpeed JSON/HJSON/dict/base64 -> ``SlipstreamConfig``: aliases, "auto", batch triple.

This is the only place that reads raw config dicts. Parsing runs in four passes:
1. load (file, base64 string or mapping; duplicate keys rejected),
2. rename deprecated aliases with a warning and reject keys slipstream does not know,
3. resolve ``"auto"`` values from the model, the optimizer and the world, or reject them,
4. validate into typed models and resolve the batch triple for the data-parallel size.
"""

from __future__ import annotations

import base64
import binascii
import copy
import json
import os
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from slipstream._logging import log_rank0
from slipstream.config._base import validate_model
from slipstream.config._errors import ConfigError, type_error_message
from slipstream.config.auto import AUTO, BATCH_KEYS, AutoContext, is_auto, resolve_auto
from slipstream.config.parallel import check_parallel_config
from slipstream.config.schema import (
    GRADIENT_CLIPPING_DEFAULT,
    NOT_YET_IMPLEMENTED,
    SlipstreamConfig,
)
from slipstream.version import DEEPSPEED_VERSION

__all__ = ["AutoContext", "load_config", "parse_config", "resolve_batch_sizes"]

# (old name, new name) at the top level and inside zero_optimization.
_TOP_ALIASES = {"bfloat16": "bf16"}
_ZERO_ALIASES = {
    "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save"
}
# DeepSpeed accepts the stage-3 keys with and without their "stage3_" prefix.
_ZERO_SHORT_NAMES = (
    "prefetch_bucket_size",
    "param_persistence_threshold",
    "model_persistence_threshold",
    "max_live_parameters",
    "max_reuse_distance",
    "gather_16bit_weights_on_model_save",
    "module_granularity_threshold",
    "use_all_reduce_for_fetch_params",
    "allgather_sequential",
)


class _DuplicateKeyError(ConfigError):
    pass


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKeyError(f"duplicate key '{key}' in config file: keep one of them")
        out[key] = value
    return out


def load_config(config: Mapping[str, Any] | str | os.PathLike[str]) -> dict[str, Any]:
    """Read a config from a mapping, a JSON/HJSON file path, or a base64-encoded JSON string.

    Raises:
        ConfigError: a value of another type, a directory, an unreadable or empty file,
            duplicate keys, or a string that is neither a path nor base64 JSON.
    """
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    if not isinstance(config, str | os.PathLike):
        raise ConfigError(
            f"config = {config!r} ({type(config).__name__}) is not a config: pass a dict, a "
            "path to a JSON/HJSON file, a base64-encoded JSON string or a SlipstreamConfig"
        )
    path = Path(config)
    if path.is_file():
        return _parse_text(_read(path), f"config file '{path}'")
    if path.is_dir():
        raise ConfigError(
            f"config path '{path}' is a directory: pass the JSON/HJSON file inside it "
            "(e.g. ds_config.json)"
        )
    text = str(config)
    not_found = ConfigError(
        f"config '{text}' is not an existing file and not base64-encoded JSON: "
        "pass a dict, a path to a JSON/HJSON file, or a SlipstreamConfig"
    )
    if text.endswith((".json", ".hjson")) or os.sep in text:
        raise ConfigError(f"config file '{text}' does not exist")
    try:
        decoded = base64.urlsafe_b64decode(text.encode()).decode()
        return _parse_text(decoded, "base64 config")
    except _DuplicateKeyError:
        raise
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise not_found from None


def _read(path: Path) -> str:
    """The file's text, or a ConfigError naming the path and the reason."""
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file '{path}': {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"config file '{path}' is not UTF-8 text ({exc.reason} at byte {exc.start}): "
            "is it the right file?"
        ) from None


def _parse_text(text: str, source: str) -> dict[str, Any]:
    """JSON, else HJSON (DeepSpeed accepts both); the top level must be an object."""
    import hjson

    if not text.strip():
        raise ConfigError(
            f"{source} is empty: it must hold a JSON object with at least a batch size, e.g. "
            '{"train_micro_batch_size_per_gpu": 4}'
        )

    try:
        data: Any = json.loads(text, object_pairs_hook=_reject_duplicates)
    except json.JSONDecodeError:
        try:
            data = hjson.loads(text, object_pairs_hook=_reject_duplicates)
        except hjson.HjsonDecodeError as exc:
            raise ConfigError(f"{source} is neither valid JSON nor HJSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"{source} must hold a JSON object ({{...}}) at the top level, got {type(data).__name__}"
        )
    return dict(data)


def _apply_aliases(raw: dict[str, Any]) -> None:
    """Rename deprecated DeepSpeed keys in place, warning once per key."""
    for old, new in _TOP_ALIASES.items():
        if old in raw:
            _warn_alias(old, new)
            raw.setdefault(new, raw.pop(old))
    zero = raw.get("zero_optimization")
    if isinstance(zero, bool):
        warnings.warn(
            "'zero_optimization': true/false is deprecated; use {'stage': 1} or {'stage': 0}",
            DeprecationWarning,
            stacklevel=_first_frame_outside_config(),
        )
        raw["zero_optimization"] = {"stage": 1 if zero else 0}
        return
    if not isinstance(zero, dict):
        return
    for short in _ZERO_SHORT_NAMES:
        if short in zero:
            zero.setdefault(f"stage3_{short}", zero.pop(short))
    for old, new in _ZERO_ALIASES.items():
        if old in zero:
            _warn_alias(f"zero_optimization.{old}", f"zero_optimization.{new}")
            zero.setdefault(new, zero.pop(old))
    if "cpu_offload" in zero:
        _warn_alias("zero_optimization.cpu_offload", "zero_optimization.offload_optimizer")
        if zero.pop("cpu_offload"):
            zero.setdefault("offload_optimizer", {"device": "cpu"})
    if "cpu_offload_param" in zero:
        _warn_alias("zero_optimization.cpu_offload_param", "zero_optimization.offload_param")
        if zero.pop("cpu_offload_param"):
            zero.setdefault("offload_param", {"device": "cpu"})
    if "cpu_offload_use_pin_memory" in zero:
        _warn_alias("zero_optimization.cpu_offload_use_pin_memory", "offload_*.pin_memory")
        pin = zero.pop("cpu_offload_use_pin_memory")
        for key in ("offload_optimizer", "offload_param"):
            if isinstance(zero.get(key), dict):
                zero[key].setdefault("pin_memory", pin)


def normalize_zero_block(block: Mapping[str, Any]) -> dict[str, Any]:
    """A ``zero_optimization`` block with DeepSpeed's deprecated and short key names renamed
    to the typed config's (a copy; each rename warns as in a whole config)."""
    raw: dict[str, Any] = {"zero_optimization": dict(block)}
    _apply_aliases(raw)
    return dict(raw["zero_optimization"])


def _warn_alias(old: str, new: str) -> None:
    warnings.warn(
        f"config key '{old}' is deprecated; use '{new}'",
        DeprecationWarning,
        stacklevel=_first_frame_outside_config(),
    )


def _first_frame_outside_config() -> int:
    """The ``stacklevel`` that attributes a warning to the code calling into this package."""
    here = str(Path(__file__).parent)
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(here):
        frame, level = frame.f_back, level + 1
    return level


def _check_sum_reduction(raw: dict[str, Any]) -> None:
    """Refuse ``gradient_allreduce_op: "sum"`` where DeepSpeed does, with its reasons."""
    op = raw.get("gradient_allreduce_op")
    if not (isinstance(op, str) and op.lower() == "sum"):
        return
    zero = raw.get("zero_optimization")
    zero = zero if isinstance(zero, dict) else {}
    compile_block = raw.get("compile")
    if zero.get("stage") == 3:
        where = "ZeRO stage 3"
    elif zero.get("zenflow") is not None:
        where = "ZenFlow"
    elif isinstance(compile_block, dict) and compile_block.get("deepcompile"):
        where = "DeepCompile"
    else:
        return
    raise ConfigError(
        f"config key 'gradient_allreduce_op' = {op!r} is not supported with {where} (DeepSpeed "
        "refuses the same combination): use 'mean'"
    )


def _strip_not_yet_implemented(raw: dict[str, Any]) -> None:
    """Drop known-but-unimplemented blocks that are disabled; reject enabled ones."""
    for key, reason in NOT_YET_IMPLEMENTED.items():
        if key not in raw:
            continue
        value = raw[key]
        if isinstance(value, dict) and not isinstance(value.get("enabled", False), bool):
            raise ConfigError(
                type_error_message(f"{key}.enabled", value["enabled"], "bool_type") or key
            )
        # Blocks whose DeepSpeed default is "enabled": false are off unless enabled is set;
        # blocks without an enabled switch are on as soon as they hold any option.
        default_on = key in _BLOCKS_WITHOUT_ENABLED
        disabled = (
            value is None
            or value is False
            or (isinstance(value, dict) and not value.get("enabled", default_on and bool(value)))
            or (key == "sequence_parallel_size" and value in (1, AUTO))
        )
        if not disabled:
            raise ConfigError(
                f"config key '{key}' = {value!r} cannot be honoured: {reason}. "
                f"Remove '{key}' (or set its 'enabled' to false)"
            )
        del raw[key]


def _drop_null_monitors(raw: dict[str, Any]) -> None:
    """``"wandb": null`` (as config generators write an unused block) means the default: off."""
    for key in ("tensorboard", "csv_monitor", "wandb", "comet"):
        if key in raw and raw[key] is None:
            del raw[key]


# Top-level keys found in DeepSpeed configs that DeepSpeed itself never reads: they are
# dropped with a warning (with what to use instead) rather than refused as unknown.
IGNORED_BY_DEEPSPEED = {
    "cuda_visible_devices": "select devices with the CUDA_VISIBLE_DEVICES environment variable "
    "or the launcher's --include/--exclude",
}


def _drop_keys_deepspeed_ignores(raw: dict[str, Any]) -> None:
    for key, instead in IGNORED_BY_DEEPSPEED.items():
        if key in raw:
            warnings.warn(
                f"config key '{key}' = {raw.pop(key)!r} is ignored, as DeepSpeed ignores it: "
                f"{instead}",
                UserWarning,
                stacklevel=_first_frame_outside_config(),
            )


_BLOCKS_WITHOUT_ENABLED = frozenset(
    {
        "checkpoint",
        "compile",
        "timers",
        "sparse_attention",
    }
)


def resolve_batch_sizes(
    train_batch_size: int | None,
    micro_batch: int | None,
    grad_accum: int | None,
    dp_world_size: int,
) -> tuple[int, int, int]:
    """Resolve DeepSpeed's batch triple; any two determine the third.

    Returns:
        (train_batch_size, micro batch per rank, gradient accumulation steps).
    Raises:
        ConfigError: naming all three values, the data-parallel size and a fix.
    """
    tbs, mb, gas, dp = train_batch_size, micro_batch, grad_accum, dp_world_size
    if dp < 1:
        raise ConfigError(f"data-parallel world size must be >= 1, got {dp}")
    for key, value in zip(BATCH_KEYS, (tbs, mb, gas)):
        if value is not None and value < 1:
            raise ConfigError(f"config key '{key}' = {value!r} must be a positive integer")
    shown = (
        f"train_batch_size={tbs}, train_micro_batch_size_per_gpu={mb}, "
        f"gradient_accumulation_steps={gas}, data-parallel world size={dp}"
    )
    if tbs is None and mb is None:
        raise ConfigError(
            f"batch size is missing ({shown}): set train_micro_batch_size_per_gpu "
            "(and optionally gradient_accumulation_steps) or train_batch_size"
        )
    if tbs is not None and mb is not None and gas is not None:
        if tbs != mb * gas * dp:
            raise ConfigError(
                f"batch sizes do not multiply out: train_batch_size must equal "
                f"train_micro_batch_size_per_gpu * gradient_accumulation_steps * world size, "
                f"but {tbs} != {mb} * {gas} * {dp} ({shown}). Fix: set train_batch_size to "
                f"{mb * gas * dp}, or drop one of the three keys and let slipstream infer it"
            )
        return tbs, mb, gas
    if tbs is None:
        assert mb is not None
        gas = gas or 1
        return mb * gas * dp, mb, gas
    if mb is None:
        gas = gas or 1
        if tbs % (gas * dp):
            raise ConfigError(
                f"train_batch_size {tbs} is not divisible by gradient_accumulation_steps * "
                f"world size = {gas} * {dp} ({shown}). Fix: use a train_batch_size that is a "
                f"multiple of {gas * dp}"
            )
        return tbs, tbs // (gas * dp), gas
    if tbs % (mb * dp):
        raise ConfigError(
            f"train_batch_size {tbs} is not divisible by train_micro_batch_size_per_gpu * "
            f"world size = {mb} * {dp} ({shown}). Fix: use a train_batch_size that is a "
            f"multiple of {mb * dp}"
        )
    return tbs, mb, tbs // (mb * dp)


def _batch_value(raw: dict[str, Any], key: str) -> int | None:
    value = raw.pop(key, None)
    if value is None or is_auto(value):
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        fix = f" (write {int(value)})" if isinstance(value, float) and value.is_integer() else ""
        raise ConfigError(f"config key '{key}' = {value!r} must be a positive integer{fix}")
    return value


def parse_config(
    config: SlipstreamConfig | Mapping[str, Any] | str | os.PathLike[str],
    *,
    dp_world_size: int = 1,
    auto: AutoContext | None = None,
) -> SlipstreamConfig:
    """Parse and validate a config, resolve ``"auto"`` and the batch triple.

    Args:
        config: a ``SlipstreamConfig``, a dict, a JSON/HJSON path, or a base64 JSON string.
        dp_world_size: data-parallel world size used for the batch arithmetic.
        auto: where ``"auto"`` values come from (model, optimizer); None rejects them.
    Raises:
        ConfigError: unknown key (with did-you-mean), bad value, unresolvable ``"auto"``,
            inconsistent batch sizes, fp16 together with bf16.
    """
    return resolve_batch(read_config(config, auto=auto), dp_world_size)


def read_config(
    config: SlipstreamConfig | Mapping[str, Any] | str | os.PathLike[str],
    *,
    auto: AutoContext | None = None,
) -> SlipstreamConfig:
    """Everything ``parse_config`` does except the batch arithmetic, which needs the
    data-parallel size, and that needs the mesh sizes this config holds: ``initialize``
    reads the config once with this, builds the mesh, then calls ``resolve_batch``.

    The batch keys keep the values given (None where absent or ``"auto"``).
    """
    if isinstance(config, SlipstreamConfig):
        raw = config.model_dump(exclude_unset=True)
    else:
        raw = load_config(config)
    ctx = auto or AutoContext()
    _apply_aliases(raw)
    _check_sum_reduction(raw)
    _strip_not_yet_implemented(raw)
    _drop_null_monitors(raw)
    _drop_keys_deepspeed_ignores(raw)
    if raw.get("steps_per_print") == float("inf"):  # Accelerate's "never print"
        raw["steps_per_print"] = None
    batch = {k: _batch_value(raw, k) for k in BATCH_KEYS}
    resolve_auto(raw, ctx)
    cfg: SlipstreamConfig = validate_model(SlipstreamConfig, raw, "")
    cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps = (
        batch[key] for key in BATCH_KEYS
    )
    _check_consistency(cfg)
    if "gradient_clipping" not in raw:
        _note_default_clipping()
    _note_auto_defaults(cfg, ctx.defaulted)
    return cfg


def _note_auto_defaults(cfg: SlipstreamConfig, keys: list[str]) -> None:
    """Log the "auto" keys that took DeepSpeed's default, with the value, on rank 0."""
    for key in keys:
        value: Any = cfg
        for part in key.split("."):
            value = getattr(value, part, None)
        log_rank0(
            '%s = "auto": DeepSpeed\'s default %s is used, as DeepSpeed %s does (it drops '
            '"auto" here; bucket sizes follow config.hidden_size when the model has one)',
            key,
            value,
            DEEPSPEED_VERSION,
        )


def resolve_batch(cfg: SlipstreamConfig, dp_world_size: int) -> SlipstreamConfig:
    """Fill in the batch triple of a ``read_config`` result for ``dp_world_size`` ranks."""
    tbs, mb, gas = resolve_batch_sizes(
        cfg.train_batch_size,
        cfg.train_micro_batch_size_per_gpu,
        cfg.gradient_accumulation_steps,
        dp_world_size,
    )
    cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu = tbs, mb
    cfg.gradient_accumulation_steps = gas
    return cfg


_clipping_default_noted = False


def _note_default_clipping() -> None:
    """Say once per process (on rank 0) that the absent key means clipping at 1.0.

    DeepSpeed changed this default in 0.19.3, so a config written for an older DeepSpeed
    now clips; the log line makes that visible instead of silent.
    """
    global _clipping_default_noted
    if _clipping_default_noted:
        return
    _clipping_default_noted = True
    log_rank0(
        "config has no 'gradient_clipping': clipping the global gradient norm at %s, the "
        "default of DeepSpeed %s (0.19.2 and earlier did not clip); set "
        '"gradient_clipping": 0.0 to turn clipping off',
        GRADIENT_CLIPPING_DEFAULT,
        DEEPSPEED_VERSION,
    )


def _check_consistency(cfg: SlipstreamConfig) -> None:
    """Cross-field rules, and options slipstream accepts but does not honour yet (refused)."""
    check_parallel_config(cfg.pipeline)
    if cfg.tensor_parallel.sequence_parallel and cfg.activation_checkpointing.partition_activations:
        raise ConfigError(
            "activation_checkpointing.partition_activations with "
            "tensor_parallel.sequence_parallel: the checkpointed activations are already split "
            "along the sequence across the TP ranks (partitioning assumes identical copies); "
            "set partition_activations to false"
        )
    if cfg.tensor_parallel.sequence_parallel and cfg.tensor_parallel.autotp_size == 1:
        raise ConfigError(
            "tensor_parallel.sequence_parallel is true but tensor_parallel.autotp_size is 1: "
            "Megatron-style sequence parallelism splits the sequence over the TP ranks; set "
            "autotp_size >= 2 (or use sequence_parallel_size for Ulysses/LSS)"
        )
    if cfg.fp16.enabled and cfg.bf16.enabled:
        raise ConfigError(
            "fp16.enabled and bf16.enabled are both true: choose one precision "
            "(bf16 needs no loss scaling and is preferred on hardware that supports it)"
        )
    zero = cfg.zero_optimization
    if zero.stage == 3:
        defaults = type(zero)()
        for key in (
            "stage3_max_reuse_distance",
            "stage3_model_persistence_threshold",
            "stage3_module_granularity_threshold",
            "stage3_use_all_reduce_for_fetch_params",
            "stage3_allgather_sequential",
        ):
            if getattr(zero, key) != getattr(defaults, key):
                raise ConfigError(
                    f"zero_optimization.{key} = {getattr(zero, key)!r} is not honoured yet by "
                    f"slipstream's ZeRO-3: remove it or use the default "
                    f"{getattr(defaults, key)!r}"
                )
    if zero.offload_param is not None and zero.offload_param.enabled:
        if zero.stage != 3:
            raise ConfigError(
                f"zero_optimization.offload_param needs stage 3 (parameters are partitioned "
                f"only there), but stage = {zero.stage}: set stage 3 or remove offload_param"
            )
        if zero.offload_param.device == "nvme":
            raise ConfigError(
                "zero_optimization.offload_param.device = 'nvme' is not implemented yet (only "
                "'cpu'): use 'cpu', or offload the optimizer states to NVMe instead"
            )
    off = zero.offload_optimizer
    if off is not None and off.device == "nvme" and not off.nvme_path:
        raise ConfigError(
            "zero_optimization.offload_optimizer.device = 'nvme' needs nvme_path: a directory "
            "on a fast local disk for the swap files"
        )
    if off is not None and off.ratio != 1.0:
        raise ConfigError(
            "zero_optimization.offload_optimizer.ratio < 1 (partial offload) is not implemented yet"
        )
    zpp = {
        "zero_quantized_nontrainable_weights": zero.zero_quantized_nontrainable_weights,
        "zero_quantized_weights": zero.zero_quantized_weights,
        "zero_quantized_gradients": zero.zero_quantized_gradients,
        "zero_hpz_partition_size": zero.zero_hpz_partition_size != 1,
    }
    for key, on in zpp.items():
        if on and zero.stage != 3:
            raise ConfigError(
                f"zero_optimization.{key} (ZeRO++) works with stage 3, but stage = "
                f"{zero.stage}: set stage 3 or remove {key}"
            )
    if zero.zero_quantized_gradients_block_size % 2:
        raise ConfigError(
            "zero_optimization.zero_quantized_gradients_block_size must be even (int4 codes "
            f"are packed two per byte), got {zero.zero_quantized_gradients_block_size}"
        )
    if zero.mics_shard_size > 0:
        raise ConfigError(
            "zero_optimization.mics_shard_size (MiCS) is not implemented yet; remove it"
        )
    if cfg.sparse_gradients:
        raise ConfigError("sparse_gradients = true is not supported: set it to false")
    if cfg.fp16.fp16_master_weights_and_grads:
        raise ConfigError("fp16.fp16_master_weights_and_grads is not implemented yet; remove it")
    _check_nonfinite_policy(cfg)
    _check_sequence_parallel_mode(cfg)
    bf16 = cfg.bf16
    if bf16.bf16_optimizer_states != bf16.bf16_master_weights_and_grads:
        raise ConfigError(
            f"bf16.bf16_master_weights_and_grads = {bf16.bf16_master_weights_and_grads} and "
            f"bf16.bf16_optimizer_states = {bf16.bf16_optimizer_states}: slipstream's optimizers "
            "keep their states in the master-weight dtype, so set both to the same value"
        )


def _check_sequence_parallel_mode(cfg: SlipstreamConfig) -> None:
    """``sequence_parallel_ring_size`` against the mode and ``sequence_parallel_size``."""
    ring, sp = cfg.sequence_parallel_ring_size, cfg.sequence_parallel_size
    if ring is None:
        return
    if cfg.sequence_parallel_mode != "ring":
        raise ConfigError(
            f"config key 'sequence_parallel_ring_size' = {ring} needs "
            f"sequence_parallel_mode 'ring', but it is {cfg.sequence_parallel_mode!r}: set "
            '"sequence_parallel_mode": "ring" or remove sequence_parallel_ring_size'
        )
    if sp % ring:
        raise ConfigError(
            f"config key 'sequence_parallel_ring_size' = {ring} does not divide "
            f"sequence_parallel_size = {sp}: choose a divisor of it (the Ulysses degree is "
            "sequence_parallel_size / sequence_parallel_ring_size)"
        )


def _check_nonfinite_policy(cfg: SlipstreamConfig) -> None:
    """``nonfinite_gradients`` against the precision; an explicit opt-out is not honoured."""
    if cfg.nonfinite_gradients == "error" and cfg.fp16.enabled and cfg.fp16.loss_scale == 0:
        raise ConfigError(
            "config key 'nonfinite_gradients' = 'error' with fp16 dynamic loss scaling: an "
            "overflow is how dynamic scaling finds its scale, so those steps are always "
            "skipped; use 'skip', bf16, or a static fp16.loss_scale"
        )
    if cfg.bf16.check_grad_overflow is False:
        action = "skips" if cfg.nonfinite_gradients == "skip" else "raises on"
        warnings.warn(
            "config key 'bf16.check_grad_overflow' = false is not honoured: slipstream checks "
            "the gradient norm for inf/nan in every precision (it costs nothing extra) and "
            f"{action} such steps (see 'nonfinite_gradients'); remove "
            "the key to silence this warning",
            UserWarning,
            stacklevel=_first_frame_outside_config(),
        )
