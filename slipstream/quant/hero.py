"""ZeroQuant-HERO pieces beyond the GEMMs (arXiv 2310.17723; spec sec. 1.2).

* **Norm + quant** (``LN^quant``): token-wise INT8 quantization is placed where a row
  reduction already happens, in LayerNorm/RMSNorm. :func:`rms_norm_quant` and
  :func:`layer_norm_quant` return the normalized rows together with their int8 codes and
  per-token scales, and equal "norm, then :func:`quantize_per_token`" bit for bit.
  In a model, :func:`attach_norm_quant_` adds that epilogue to every norm: the int8 rows
  travel on the output tensor to each INT8 GEMM reading it (q/k/v share one quantization
  instead of three). In eager PyTorch this saves the repeated quantization, not a memory
  pass; a single-kernel fusion needs ``torch.compile`` or a custom kernel.
* **Smoothing** (feature-wise scales folded into the next GEMM, rule R2 / SmoothQuant):
  :func:`smooth_` divides a norm's output features by ``s`` (through its weight and bias)
  and multiplies the matching input columns of every linear reading it by ``s``; the float
  function is unchanged, while the activation outliers move into the weights.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.quant._formats import quantize_per_token
from slipstream.quant.linear import INT8_HANDOFF_ATTR

__all__ = [
    "attach_norm_quant_",
    "is_norm",
    "layer_norm_quant",
    "rms_norm_quant",
    "smooth_",
]

_HOOK_FLAG = "_slipstream_norm_quant_hook"


def rms_norm_quant(
    x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RMSNorm (fp32 statistics, as slipstream's GPT and HF Llama) with a per-token epilogue.

    Returns ``(y [..., d] in x.dtype, q int8 [..., d], scale fp32 [..., 1])``.
    """
    x32 = x.float()
    y = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    q, s = quantize_per_token(y)
    return y, q, s


def layer_norm_quant(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LayerNorm over the last dim with a per-token INT8 epilogue; see :func:`rms_norm_quant`."""
    y = F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    q, s = quantize_per_token(y)
    return y, q, s


def is_norm(mod: nn.Module) -> bool:
    """LayerNorm or any RMSNorm/LayerNorm-named class with a per-feature ``weight``."""
    name = type(mod).__name__
    return isinstance(mod, nn.LayerNorm) or (
        name.endswith(("RMSNorm", "LayerNorm"))
        and isinstance(getattr(mod, "weight", None), nn.Parameter)
    )


class _LazyRows:
    """Per-token int8 rows of a norm output, computed on first use and then shared."""

    def __init__(self, y: torch.Tensor) -> None:
        self._y: torch.Tensor | None = y
        self._rows: tuple[torch.Tensor, torch.Tensor] | None = None

    def __iter__(self) -> Any:
        if self._rows is None:
            assert self._y is not None
            self._rows = quantize_per_token(self._y.detach())
            self._y = None  # drop the reference cycle y -> attr -> y
        return iter(self._rows)


def _norm_epilogue(mod: nn.Module, args: tuple[Any, ...], out: Any) -> None:
    if isinstance(out, torch.Tensor):
        setattr(out, INT8_HANDOFF_ATTR, _LazyRows(out))


def attach_norm_quant_(model: nn.Module) -> int:
    """Give every norm of ``model`` the per-token INT8 epilogue (idempotent).

    Returns the number of norms hooked. Parameter names and the float output are unchanged.
    """
    n = 0
    for mod in model.modules():
        if is_norm(mod) and not getattr(mod, _HOOK_FLAG, False):
            mod.register_forward_hook(_norm_epilogue)
            setattr(mod, _HOOK_FLAG, True)
            n += 1
    return n


def _collect(
    model: nn.Module, batches: Iterable[Any]
) -> tuple[dict[str, list[str]], dict[str, torch.Tensor]]:
    """For each norm: the linears reading its output, and the per-feature |output| max."""
    outputs: dict[int, tuple[str, torch.Tensor]] = {}
    consumers: dict[str, list[str]] = {}
    act_max: dict[str, torch.Tensor] = {}
    handles = []

    def norm_hook(name: str) -> Any:
        def hook(mod: nn.Module, args: Any, out: torch.Tensor) -> None:
            outputs[id(out)] = (name, out)
            amax = out.detach().float().abs().reshape(-1, out.shape[-1]).amax(0)
            act_max[name] = torch.maximum(act_max[name], amax) if name in act_max else amax

        return hook

    def linear_hook(name: str) -> Any:
        def hook(mod: nn.Module, args: Any) -> None:
            src = outputs.get(id(args[0]))
            if src is not None and src[1] is args[0]:
                lst = consumers.setdefault(src[0], [])
                if name not in lst:
                    lst.append(name)

        return hook

    for name, mod in model.named_modules():
        if is_norm(mod):
            handles.append(mod.register_forward_hook(norm_hook(name)))
        elif isinstance(mod, nn.Linear):
            handles.append(mod.register_forward_pre_hook(linear_hook(name)))
    try:
        with torch.no_grad():
            for batch in batches:
                model(**batch) if isinstance(batch, dict) else model(batch)
                outputs.clear()
    finally:
        for h in handles:
            h.remove()
    return consumers, act_max


def _param(mod: nn.Module, name: str) -> torch.Tensor | None:
    p = getattr(mod, name, None)
    return p if isinstance(p, torch.Tensor) else None


def _fold(model: nn.Module, norm_name: str, linears: list[str], s: torch.Tensor) -> None:
    norm = model.get_submodule(norm_name)
    for p in (_param(norm, "weight"), _param(norm, "bias")):
        if p is not None:
            p.div_(s.to(p.dtype))
    for lin in linears:
        w = _param(model.get_submodule(lin), "weight")
        assert w is not None
        w.mul_(s.to(w.dtype))


def _weight(model: nn.Module, name: str) -> torch.Tensor:
    w = _param(model.get_submodule(name), "weight")
    if w is None:
        raise TypeError(f"module {name!r} has no weight tensor to fold smoothing scales into")
    return w


def _forward(model: nn.Module, batch: Any) -> torch.Tensor:
    out = model(**batch) if isinstance(batch, dict) else model(batch)
    if not isinstance(out, torch.Tensor):
        out = out[0] if isinstance(out, tuple) else next(iter(out.values()))
    return out.float()


@torch.no_grad()
def smooth_(
    model: nn.Module, batches: list[Any], alpha: float = 0.5, rtol: float = 1e-4
) -> list[str]:
    """Fold feature-wise smoothing scales ``s_j = max|X_j|^a / max|W_:,j|^(1-a)`` (run on the
    float model, before :func:`~slipstream.quant.quantize_`).

    A norm is folded only if the float output on ``batches[0]`` is unchanged afterwards
    (relative error <= ``rtol``), i.e. its output feeds nothing but the linears found (a
    post-LN residual would also read it; such norms are left alone).

    Returns the names of the folded norms. Cost: one forward per batch, plus one forward per
    candidate norm for the check.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"smooth_ alpha={alpha} must be in [0, 1]; SmoothQuant uses 0.5")
    if not batches:
        raise ValueError("smooth_ needs at least one calibration batch")
    consumers, act_max = _collect(model, batches)
    ref = _forward(model, batches[0])
    folded = []
    for norm_name, linears in consumers.items():
        w_max = torch.stack(
            [_weight(model, n).detach().float().abs().amax(0) for n in linears]
        ).amax(0)
        a = act_max[norm_name]
        s = (a.clamp(min=1e-5) ** alpha / w_max.clamp(min=1e-5) ** (1 - alpha)).clamp(min=1e-5)
        s = torch.where((a > 0) & (w_max > 0), s, torch.ones_like(s))
        params = [p for n in (norm_name, *linears) for p in model.get_submodule(n).parameters()]
        saved = [p.detach().clone() for p in params]
        _fold(model, norm_name, linears, s)
        out = _forward(model, batches[0])
        if (out - ref).norm() > rtol * ref.norm():
            for p, old in zip(params, saved):
                p.copy_(old)
            continue
        folded.append(norm_name)
    return folded
