"""``quantize_(model, config)``: replace linear layers in place, plus calibration and I/O.

Handlers are looked up by config type in a registry, so a new scheme is one
``@register_handler(MyConfig)`` function (torchao-style). Supported float layers:
``nn.Linear`` and Hugging Face's GPT-2 ``Conv1D`` (weight stored ``[in, out]``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from slipstream.quant.attention import Int8Attention, quantize_attention_
from slipstream.quant.config import (
    W4A8FP4,
    W8A8FP8,
    HeroModes,
    QuantConfig,
    W4A8Int4,
    W8A8Int,
)
from slipstream.quant.hero import attach_norm_quant_
from slipstream.quant.linear import QuantLinear

__all__ = [
    "calibrate",
    "load_quantized",
    "quantize_",
    "register_handler",
    "save_quantized",
]

logger = logging.getLogger(__name__)

Handler = Callable[[torch.Tensor, torch.Tensor | None, Any], nn.Module]
_HANDLERS: dict[type, Handler] = {}
C = TypeVar("C", bound=QuantConfig)
_CONFIG_TYPES: dict[str, type[QuantConfig]] = {
    c.__name__: c for c in (W8A8Int, W8A8FP8, W4A8Int4, W4A8FP4)
}


def register_handler(config_type: type[C]) -> Callable[[Handler], Handler]:
    """Decorator registering ``fn(weight [N, K], bias, config) -> nn.Module`` for a config type."""

    def deco(fn: Handler) -> Handler:
        _HANDLERS[config_type] = fn
        _CONFIG_TYPES[config_type.__name__] = config_type
        return fn

    return deco


@register_handler(W8A8Int)
def _w8a8_int(w: torch.Tensor, b: torch.Tensor | None, cfg: W8A8Int) -> nn.Module:
    return QuantLinear.from_float(
        w,
        b,
        "int8",
        "int8",
        act_static=cfg.act_scheme == "tensor",
        backend=cfg.backend,
        lorc_rank=cfg.lorc_rank,
    )


@register_handler(W8A8FP8)
def _w8a8_fp8(w: torch.Tensor, b: torch.Tensor | None, cfg: W8A8FP8) -> nn.Module:
    return QuantLinear.from_float(w, b, "e4m3", cfg.act_format, lorc_rank=cfg.lorc_rank)


@register_handler(W4A8Int4)
def _w4a8_int4(w: torch.Tensor, b: torch.Tensor | None, cfg: W4A8Int4) -> nn.Module:
    return QuantLinear.from_float(
        w,
        b,
        "int4",
        "int8",
        backend=cfg.backend,
        group_size=cfg.group_size,
        constraint=cfg.constraint,
        lorc_rank=cfg.lorc_rank,
    )


@register_handler(W4A8FP4)
def _w4a8_fp4(w: torch.Tensor, b: torch.Tensor | None, cfg: W4A8FP4) -> nn.Module:
    return QuantLinear.from_float(
        w,
        b,
        "e2m1",
        cfg.act_format,
        group_size=cfg.group_size,
        constraint=cfg.constraint,
        lorc_rank=cfg.lorc_rank,
    )


def _float_weight(mod: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``(weight [out, in], bias)`` of a supported float layer, else None."""
    if isinstance(mod, nn.Linear):
        return mod.weight, mod.bias
    weight, bias = getattr(mod, "weight", None), getattr(mod, "bias", None)
    if type(mod).__name__ == "Conv1D" and isinstance(weight, torch.Tensor):  # HF GPT-2: x @ W + b
        return weight.t(), bias if isinstance(bias, torch.Tensor) else None
    return None


def quantize_(model: nn.Module, config: QuantConfig) -> nn.Module:
    """Replace every supported linear layer of ``model`` allowed by ``config``, in place.

    Module names are kept (``layers.0.attn.q_proj`` stays addressable), so HF ``generate``
    and name-based tooling work unchanged. For :class:`W8A8Int` with ``fuse_norms`` and
    per-token activations, norms also quantize their output once for their consumers, and
    with ``modes.attn_core`` supported attention modules get the INT8 core (QK^T, PV).

    Returns ``model``. Raises TypeError for a config type with no registered handler and
    ValueError (naming the module) when a layer cannot take the config.
    """
    handler = _HANDLERS.get(type(config))
    if handler is None:
        raise TypeError(
            f"no quantization handler for {type(config).__name__}; register one with "
            f"@slipstream.quant.register_handler({type(config).__name__}) or use one of "
            f"{sorted(c.__name__ for c in _HANDLERS)}"
        )
    replaced = 0
    for name, mod in list(model.named_modules()):
        found = _float_weight(mod)
        if found is None or not name or not config.allows(name):
            continue
        try:
            new = handler(found[0], found[1], config)
        except ValueError as exc:
            raise ValueError(f"cannot quantize module {name!r}: {exc}") from exc
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
        replaced += 1
    if isinstance(config, W8A8Int) and config.fuse_norms and config.act_scheme == "token":
        attach_norm_quant_(model)
    if isinstance(config, W8A8Int) and config.modes.attn_core:
        quantize_attention_(model, config.attn_scales)
    model._slipstream_quant_config = config  # type: ignore[assignment]
    logger.info("quantize_: replaced %d layers with %s", replaced, type(config).__name__)
    return model


@torch.no_grad()
def calibrate(model: nn.Module, batches: Iterable[Any]) -> int:
    """Record static activation ranges over ``batches``: of every :class:`QuantLinear` (per
    tensor) and of every static-scale :class:`Int8Attention` (per-head Q/K, per-feature V).

    Each batch is passed as ``model(batch)`` (or ``model(**batch)`` for a dict); during
    calibration every layer runs with dynamic scales. Layers configured for static scales
    use the recorded ranges from then on. Ranges are buffers, so they are saved with the
    model. Returns the number of batches seen; raises ValueError for no batches.
    """
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    attns = [m for m in model.modules() if isinstance(m, Int8Attention) and m.scales == "static"]
    static = [m.act_static for m in layers]
    for m in layers:
        m.act_absmax.zero_()
        m.observing, m.act_static = True, False
    for a in attns:
        a.reset_ranges()
        a.observing = True
    n = 0
    try:
        for batch in batches:
            model(**batch) if isinstance(batch, dict) else model(batch)
            n += 1
    finally:
        for m, was_static in zip(layers, static):
            m.observing, m.act_static = False, was_static
        for a in attns:
            a.observing = False
    if n == 0:
        raise ValueError("calibrate got no batches; pass a non-empty iterable of model inputs")
    return n


def _config_to_json(config: QuantConfig) -> str:
    return json.dumps({"type": type(config).__name__, "fields": dataclasses.asdict(config)})


def _config_from_json(text: str) -> QuantConfig:
    data = json.loads(text)
    cls = _CONFIG_TYPES.get(data["type"])
    if cls is None:
        raise ValueError(f"unknown quantization config type {data['type']!r} in checkpoint")
    fields = dict(data["fields"])
    fields["skip"] = tuple(fields.get("skip", ()))
    if "modes" in fields:
        fields["modes"] = HeroModes(**fields["modes"])
    return cls(**fields)


def save_quantized(model: nn.Module, path: str | Path) -> None:
    """Write a quantized model's state (int/fp8/packed buffers included) to safetensors.

    The config travels in the file's metadata so :func:`load_quantized` can rebuild the
    module structure. Tied tensors are saved once per name (cloned).
    """
    from safetensors.torch import save_file

    config = getattr(model, "_slipstream_quant_config", None)
    if config is None:
        raise ValueError("save_quantized: model was not quantized with slipstream.quant.quantize_")
    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    save_file(state, str(path), metadata={"slipstream_quant": _config_to_json(config)})


def load_quantized(model: nn.Module, path: str | Path) -> nn.Module:
    """Quantize a float ``model`` of the same architecture as saved, then load the saved state.

    The float weights only fix the structure; every tensor is overwritten (strict load).
    """
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if "slipstream_quant" not in meta:
        raise ValueError(f"{path} has no slipstream_quant metadata; save it with save_quantized")
    quantize_(model, _config_from_json(meta["slipstream_quant"]))
    state = load_file(str(path), device=str(next(model.buffers()).device))
    model.load_state_dict(state, strict=True)
    return model
