"""``init_compression`` and ``redundancy_clean`` (``deepspeed.compression.compress``).

``init_compression(model, config)`` prepares a model for compression-aware training: with
``layer_reduction`` it first initialises the student from the teacher's layers, then it makes
every Linear, Conv2d, Embedding and BatchNorm2d compression-aware (in place) and enables each
configured technique on its groups' modules. The techniques stay off until the engine's
scheduler reaches their ``schedule_offset``. ``redundancy_clean(model, config)`` bakes them
into the weights after training: quantized values, zeroed or removed rows, heads, channels.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from slipstream.compression.config import get_compression_config
from slipstream.compression.helper import recursive_getattr
from slipstream.compression.layers import is_compressible, make_compressible_
from slipstream.compression.scheduler import modules_matching
from slipstream.config.compression import CompressionConfig
from slipstream.config.schema import SlipstreamConfig
from slipstream.zero.param import is_zero_param

__all__ = ["init_compression", "redundancy_clean", "student_initialization"]

ConfigLike = Mapping[str, Any] | str | os.PathLike[str] | SlipstreamConfig | CompressionConfig

# redundancy_clean's order (DeepSpeed's): quantize first, then prune, activations last.
_CLEAN_ORDER = (
    "weight_quantization",
    "sparse_pruning",
    "row_pruning",
    "head_pruning",
    "channel_pruning",
    "activation_quantization",
)


_SNIP_ONLY = (
    "dense_ratio",
    "block_pattern",
    "schedule_offset_stride",
    "excluded_modules",
    "schedule_offset_end",
)


class _Assignment:
    """One group of one technique: its modules (per pattern), related modules, settings."""

    def __init__(
        self,
        technique: str,
        modules: list[list[str]],
        related: list[list[list[str]]],
        settings: dict[str, Any],
    ) -> None:
        self.technique = technique
        self.modules = modules
        self.related = related
        self.settings = settings


def _unwrap(model: nn.Module) -> nn.Module:
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, nn.Module) else model


def _assignments(model: nn.Module, cfg: CompressionConfig) -> list[_Assignment]:
    """Each technique's groups resolved to module names (every technique, enabled or not,
    as DeepSpeed resolves them; a module in two groups of one technique is an error)."""
    out = []
    for key, tech in cfg.techniques().items():
        taken: set[str] = set()
        shared = tech.shared_parameters.model_dump()  # type: ignore[attr-defined]
        for option in _SNIP_ONLY:  # snip_momentum's; a group's own dense_ratio must win
            shared.pop(option, None)
        for group, spec in (tech.different_groups or {}).items():
            modules, related = [], []
            patterns = spec.modules
            for i, pattern in enumerate(patterns):
                modules.append(modules_matching(model, pattern, taken, group=group, strict=True))
                if spec.related_modules is not None:
                    related.append(
                        [
                            modules_matching(model, rp, set(), group=group, strict=True)
                            for rp in (
                                spec.related_modules[i] if i < len(spec.related_modules) else []
                            )
                        ]
                    )
            if any(modules):
                settings = {**spec.params.model_dump(), **shared}
                out.append(_Assignment(key, modules, related, settings))
    return out


def _enable(module: nn.Module, technique: str, s: dict[str, Any]) -> None:
    """Turn ``technique`` on in ``module`` (still off until the scheduler's switch)."""
    if not s["enabled"]:
        return
    m: Any = module
    if technique == "weight_quantization":
        m.enable_weight_quantization(
            s["target_bits"],
            s["quantize_weight_in_forward"],
            s["quantization_type"],
            s["quantize_groups"],
        )
        # MoQ's bit schedule (quantize_weight_in_forward false; slipstream.compression.moq).
        m.moq_start_bits, m.moq_period = s["start_bits"], s["quantization_period"]
    elif technique == "activation_quantization":
        m.enable_activation_quantization(s["bits"], s["quantization_type"], s["range_calibration"])
    elif technique == "sparse_pruning":
        m.enable_sparse_pruning(s["dense_ratio"], s["method"])
    elif technique == "row_pruning":
        m.enable_row_pruning(s["dense_ratio"], s["method"])
    elif technique == "head_pruning":
        m.enable_head_pruning(s["dense_ratio"], s["method"], s["num_heads"])
    elif technique == "channel_pruning":
        m.enable_channel_pruning(s["dense_ratio"], s["method"])


def _check_supports(module: nn.Module, name: str, technique: str) -> None:
    need = {
        "row_pruning": "enable_row_pruning",
        "head_pruning": "enable_head_pruning",
        "channel_pruning": "enable_channel_pruning",
        "activation_quantization": "enable_activation_quantization",
        "weight_quantization": "enable_weight_quantization",
        "sparse_pruning": "enable_sparse_pruning",
    }[technique]
    if not hasattr(module, need):
        raise ValueError(
            f"compression_training.{technique}: module {name!r} is a "
            f"{type(module).__name__}, which {technique} does not apply to; narrow the "
            "group's 'modules' patterns"
        )


def init_compression(
    model: nn.Module,
    deepspeed_config: ConfigLike,
    teacher_model: nn.Module | None = None,
    mpu: Any = None,
) -> nn.Module:
    """Prepare ``model`` (in place; returned) for compression-aware training.

    Args:
        model: the model, or a wrapper with ``.module``.
        deepspeed_config: a DeepSpeed config (dict, JSON path, parsed config) with a
            ``compression_training`` block.
        teacher_model: the model ``layer_reduction`` copies layers from.
        mpu: Megatron's model-parallel unit; not supported (must be None).
    Raises:
        ConfigError: a bad or refused ``compression_training`` block.
        ValueError: ``layer_reduction`` without a teacher, a module in two groups of one
            technique, a technique on a module kind it does not apply to, or an ``mpu``.
    """
    _refuse_mpu(mpu)
    cfg = get_compression_config(deepspeed_config)
    c_model = _unwrap(model)
    _check_whole(c_model, "init_compression")
    if cfg.layer_reduction.enabled:
        if teacher_model is None:
            raise ValueError(
                "compression_training.layer_reduction is enabled: pass the teacher, "
                "init_compression(model, config, teacher_model=teacher)"
            )
        student_initialization(c_model, _unwrap(teacher_model), cfg)
    for _, module in c_model.named_modules():
        if is_compressible(module):
            make_compressible_(module)
    for item in _assignments(c_model, cfg):
        for names in item.modules:
            for name in names:
                module = recursive_getattr(c_model, name)
                if item.settings["enabled"]:
                    _check_supports(module, name, item.technique)
                _enable(module, item.technique, item.settings)
    return model


def redundancy_clean(model: nn.Module, deepspeed_config: ConfigLike, mpu: Any = None) -> nn.Module:
    """Bake the compression into ``model``'s weights (in place; returned): quantized weight
    values (``quantize_weight_in_forward``), sparse masks applied, and pruned rows, heads and
    channels zeroed, or removed together with the matching inputs of ``related_modules``."""
    _refuse_mpu(mpu)
    cfg = get_compression_config(deepspeed_config)
    c_model = _unwrap(model)
    _check_whole(c_model, "redundancy_clean")
    items = sorted(_assignments(c_model, cfg), key=lambda a: _CLEAN_ORDER.index(a.technique))
    for item in items:
        shrink = bool(item.related)
        masks: list[torch.Tensor | None] = []
        for i, names in enumerate(item.modules):
            for name in names:
                mask = _fix(c_model, name, item, None, shrink)
                if shrink:
                    masks.append(mask)
            if shrink:
                # As DeepSpeed: the j-th related module of a pattern takes the j-th mask
                # stored so far for this group.
                for related_names in item.related[i]:
                    for j, name in enumerate(related_names):
                        _fix(c_model, name, item, masks[j], True)
    return model


def _fix(
    model: nn.Module,
    name: str,
    item: _Assignment,
    mask: torch.Tensor | None,
    shrink: bool,
) -> torch.Tensor | None:
    m: Any = recursive_getattr(model, name)
    s, t = item.settings, item.technique
    if t == "weight_quantization" and s["quantize_weight_in_forward"] and s["enabled"]:
        m.fix_weight_quantization()
    elif t == "sparse_pruning" and s["enabled"]:
        m.fix_sparse_pruning_helper()
    elif t == "row_pruning" and (s["enabled"] or mask is not None):
        return m.fix_row_col_pruning_helper(mask, dim_reduction=shrink)  # type: ignore[no-any-return]
    elif t == "head_pruning" and (s["enabled"] or mask is not None):
        return m.fix_head_pruning_helper(mask, s.get("num_heads"), dim_reduction=shrink)  # type: ignore[no-any-return]
    elif t == "channel_pruning" and (s["enabled"] or mask is not None):
        return m.fix_channel_pruning_helper(mask, dim_reduction=shrink)  # type: ignore[no-any-return]
    return None


def student_initialization(
    student_model: nn.Module, teacher_model: nn.Module, deepspeed_config: ConfigLike
) -> None:
    """Copy teacher layer ``teacher_layer[i]`` into student layer i (under
    ``module_name_prefix``) and each ``other_module_name`` module whole, parameter by
    parameter in registration order (ZeroQuant's layer-reduction start, arXiv:2206.01861
    sec. 4.3).

    Raises:
        ValueError: a layer or module whose parameters differ in count or shape.
    """
    lr = get_compression_config(deepspeed_config).layer_reduction
    assert lr.module_name_prefix is not None and lr.teacher_layer is not None
    pairs = [
        (f"{lr.module_name_prefix}.{s}", f"{lr.module_name_prefix}.{t}")
        for s, t in enumerate(lr.teacher_layer)
    ]
    pairs += [(name, name) for name in lr.other_module_name]
    for s_name, t_name in pairs:
        s_params = list(recursive_getattr(student_model, s_name).parameters())
        t_params = list(recursive_getattr(teacher_model, t_name).parameters())
        shapes = [tuple(p.shape) for p in s_params], [tuple(p.shape) for p in t_params]
        if shapes[0] != shapes[1]:
            raise ValueError(
                f"layer_reduction: student {s_name!r} and teacher {t_name!r} differ in "
                f"parameters ({shapes[0]} vs {shapes[1]}); the student must be the teacher's "
                "architecture with fewer layers"
            )
        with torch.no_grad():
            for s_param, t_param in zip(s_params, t_params, strict=True):
                s_param.copy_(t_param)


def _check_whole(model: nn.Module, what: str) -> None:
    """Masks and quantized values are computed from whole weights, never ZeRO-3 shards."""
    for name, p in model.named_parameters():
        if is_zero_param(p) and p.numel() == 0:
            raise ValueError(
                f"{what}: parameter {name!r} is a ZeRO-3 shard (empty here), and compression "
                "needs whole weights. Call init_compression before deepspeed.initialize and "
                "outside zero.Init; call redundancy_clean on a model loaded from the "
                "consolidated weights (engine.save_16bit_model, or "
                "get_fp32_state_dict_from_zero_checkpoint)"
            )


def _refuse_mpu(mpu: Any) -> None:
    if mpu is not None:
        raise ValueError(
            "init_compression/redundancy_clean: mpu (Megatron's ColumnParallelLinear/"
            "RowParallelLinear) is not supported by slipstream's compression library; "
            "compress the model before applying tensor parallelism (mpu=None)"
        )
