"""Low-rank adaptation (LoRA, Hu et al. 2021, arXiv 2106.09685, sec. 4.1) with DeepSpeed-Chat's
surface (``convert_linear_layer_to_lora``, ``only_optimize_lora_parameters``,
``convert_lora_to_linear_layer``, ``fuse_lora_weight`` / ``unfuse_lora_weight``).

A converted layer computes ``y = x W^T + b + scaling * dropout(x) A^T B^T`` with the frozen base
weight ``W [out, in]``, ``A [r, in]`` (Kaiming-uniform, as ``nn.Linear``) and ``B [out, r]``
(zeros, so the model is unchanged at conversion) and ``scaling = alpha / r``.

Conversion is an in-place transform that keeps parameter names: the base weight stays
``<layer>.weight`` (and ``.bias``), so a checkpoint of the unconverted model loads into the
converted one with ``strict=False``, and the adapters are ``<layer>.lora_a`` / ``.lora_b``.

For generation, DeepSpeed-Chat's hybrid engine *fuses* the adapters into the base weight
(``W += scaling * B A``), so decoding runs one GEMM per layer, and *unfuses* them (``W -=
scaling * B A``) before training continues. :func:`fuse_lora_` / :func:`unfuse_lora_` do the
same; the delta is computed in fp32, so an fp32 round trip is exact up to fp32 rounding. For
bf16/fp16 base weights, whose rounding would accumulate over many rounds, ``keep_base=True``
keeps a copy of the unfused weight and restores it bit for bit (at the cost of one weight).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.zero.param import full_numel

__all__ = [
    "LoRALinear",
    "apply_lora_",
    "convert_linear_layer_to_lora",
    "convert_lora_to_linear_layer",
    "fuse_lora_",
    "fused_lora",
    "load_lora_state_dict",
    "lora_parameters",
    "lora_state_dict",
    "only_optimize_lora_parameters",
    "unfuse_lora_",
]

_LORA_NAMES = ("lora_a", "lora_b")


class LoRALinear(nn.Module):
    """A linear layer with a trainable low-rank update (module doc).

    Built from an existing ``nn.Linear`` with :meth:`from_linear`; it takes over that layer's
    ``weight`` and ``bias`` parameters (same tensors, same names), frozen.
    """

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, rank: int, alpha: float,
        dropout: float = 0.0,
    ) -> None:  # fmt: skip
        super().__init__()
        if not isinstance(weight, nn.Parameter) or not isinstance(bias, nn.Parameter | None):
            raise TypeError(
                "LoRALinear: weight and bias must be the base layer's nn.Parameters (got "
                f"{type(weight).__name__}, {type(bias).__name__}); use LoRALinear.from_linear"
            )
        if rank < 1:
            raise ValueError(f"LoRALinear: rank={rank} must be >= 1 (use 8-64 for most layers)")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"LoRALinear: dropout={dropout} must be in [0, 1)")
        out_features, in_features = weight.shape
        self.in_features, self.out_features = in_features, out_features
        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank
        self.weight = weight
        self.bias = bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        kw: dict[str, Any] = {"device": weight.device, "dtype": weight.dtype}
        self.lora_a = nn.Parameter(torch.empty(rank, in_features, **kw))
        self.lora_b = nn.Parameter(torch.zeros(out_features, rank, **kw))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.fused = False
        self._base: torch.Tensor | None = None  # the unfused weight, with keep_base=True
        self._fused_versions: tuple[int, int] = (0, 0)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, rank: int, alpha: float, dropout: float = 0.0
    ) -> LoRALinear:
        """Wrap ``linear``'s own parameters (no copy)."""
        return cls(linear.weight, linear.bias, rank, alpha, dropout)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, rank={self.rank}, alpha={self.alpha}, "
            f"fused={self.fused}"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if self.fused:
            if torch.is_grad_enabled() and self.lora_a.requires_grad:
                raise RuntimeError(
                    "LoRALinear: the adapters are fused into the base weight, so they would get "
                    "no gradient; call unfuse_lora_(model) before training (or run under "
                    "torch.no_grad() for generation)"
                )
            return out
        low = F.linear(F.linear(self.lora_dropout(x), self.lora_a), self.lora_b)
        return out + low * self.scaling

    def delta(self) -> torch.Tensor:
        """``scaling * B A`` in fp32, ``[out, in]``."""
        self._check_whole("fuse or unfuse")
        return (self.lora_b.detach().float() @ self.lora_a.detach().float()) * self.scaling

    @torch.no_grad()
    def fuse_(self, keep_base: bool = False) -> None:
        """``W += scaling * B A``; the forward is then one plain linear. Idempotent."""
        if self.fused:
            return
        self._check_whole("fuse")
        if keep_base:
            self._base = self.weight.detach().clone()
        self.weight.copy_((self.weight.float() + self.delta()).to(self.weight.dtype))
        self._fused_versions = (self.lora_a._version, self.lora_b._version)
        self.fused = True

    @torch.no_grad()
    def unfuse_(self) -> None:
        """Undo :meth:`fuse_`: restore the kept copy, or subtract the same delta. Idempotent.

        Raises:
            RuntimeError: the adapters changed while fused (the delta to subtract is lost).
        """
        if not self.fused:
            return
        if self._base is not None:
            self.weight.copy_(self._base)
            self._base = None
        else:
            if (self.lora_a._version, self.lora_b._version) != self._fused_versions:
                raise RuntimeError(
                    "LoRALinear.unfuse_: lora_a/lora_b were modified while fused, so the fused "
                    "delta cannot be subtracted; do not step the optimizer between "
                    "fuse_lora_ and unfuse_lora_ (or fuse with keep_base=True)"
                )
            self.weight.copy_((self.weight.float() - self.delta()).to(self.weight.dtype))
        self.fused = False

    def fuse_lora_weight(self) -> None:
        """DeepSpeed-Chat's name for :meth:`fuse_`."""
        self.fuse_()

    def unfuse_lora_weight(self) -> None:
        """DeepSpeed-Chat's name for :meth:`unfuse_`."""
        self.unfuse_()

    def _check_whole(self, what: str) -> None:
        for name, p in (("weight", self.weight), ("lora_a", self.lora_a), ("lora_b", self.lora_b)):
            if p.numel() != full_numel(p):
                raise RuntimeError(
                    f"LoRALinear: cannot {what} while {name} is partitioned by ZeRO-3 (it holds "
                    f"{p.numel()} of {full_numel(p)} elements); wrap the call in "
                    "slipstream.zero.GatheredParameters(list(model.parameters()))"
                )

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        """Checkpoints always hold the *unfused* base weight, so saving during generation is
        safe and loading never adds the delta twice."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.fused:
            base = self._base if self._base is not None else None
            if base is None:
                base = (self.weight.detach().float() - self.delta()).to(self.weight.dtype)
            destination[prefix + "weight"] = base.detach().clone()

    def _load_from_state_dict(self, state_dict: Mapping[str, Any], prefix: str, *args: Any) -> None:
        if self.fused:
            raise RuntimeError(
                f"LoRALinear {prefix.rstrip('.')!r}: load_state_dict while the adapters are "
                "fused would mix fused and unfused weights; call unfuse_lora_(model) first"
            )
        super()._load_from_state_dict(state_dict, prefix, *args)  # type: ignore[arg-type]


def _compile(patterns: str | Sequence[str]) -> list[re.Pattern[str]]:
    items = [patterns] if isinstance(patterns, str) else list(patterns)
    if not items:
        raise ValueError("apply_lora_: give at least one module-name pattern, e.g. 'q_proj'")
    return [re.compile(p) for p in items]


def apply_lora_(
    model: nn.Module,
    targets: str | Sequence[str],
    rank: int,
    alpha: float | None = None,
    dropout: float = 0.0,
) -> list[str]:
    """Replace, in place, every ``nn.Linear`` whose qualified name matches one of ``targets``
    (``re.search``, so a plain substring such as ``"q_proj"`` or ``"layers.1."`` works) by a
    :class:`LoRALinear` around the same parameters.

    Args:
        model: modified in place.
        targets: regular expression(s) over names from ``model.named_modules()``.
        rank: ``r``, the inner dimension of the update.
        alpha: the update's scale is ``alpha / rank``; default ``rank`` (scale 1).
        dropout: dropout on the adapter's input (0, DeepSpeed-Chat's default).

    Returns:
        The names of the converted layers.

    Raises:
        ValueError: no linear layer matches (the message lists the model's linear layers).
    """
    compiled = _compile(targets)
    scale = float(rank) if alpha is None else float(alpha)
    chosen = [
        (name, m)
        for name, m in model.named_modules()
        if type(m) is nn.Linear and any(p.search(name) for p in compiled)
    ]
    if not chosen:
        linears = [n for n, m in model.named_modules() if type(m) is nn.Linear]
        raise ValueError(
            f"apply_lora_: no nn.Linear of {type(model).__name__} matches {targets!r}; its "
            f"linear layers are {linears[:12]}{' ...' if len(linears) > 12 else ''}"
        )
    for name, linear in chosen:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoRALinear.from_linear(linear, rank, scale, dropout))
    return [name for name, _ in chosen]


def _lora_layers(model: nn.Module) -> Iterator[LoRALinear]:
    return (m for m in model.modules() if isinstance(m, LoRALinear))


def lora_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` of every adapter matrix (``lora_a`` / ``lora_b``)."""
    for name, p in model.named_parameters():
        if name.rpartition(".")[2] in _LORA_NAMES:
            yield name, p


def only_optimize_lora_parameters(
    model: nn.Module, force_optimize_params: Sequence[str] = ()
) -> nn.Module:
    """Freeze everything except the adapters and the parameters named in
    ``force_optimize_params`` (exact names); returns ``model`` (DeepSpeed-Chat's helper).

    Raises:
        ValueError: the model has no LoRA layer, or a forced name is not a parameter.
    """
    names = {n for n, _ in model.named_parameters()}
    missing = [n for n in force_optimize_params if n not in names]
    if missing:
        raise ValueError(
            f"only_optimize_lora_parameters: {missing} are not parameters of "
            f"{type(model).__name__}; use names from model.named_parameters()"
        )
    if not any(True for _ in _lora_layers(model)):
        raise ValueError(
            f"only_optimize_lora_parameters: {type(model).__name__} has no LoRA layer; call "
            "apply_lora_ (convert_linear_layer_to_lora) first"
        )
    keep = {n for n, _ in lora_parameters(model)} | set(force_optimize_params)
    for name, p in model.named_parameters():
        p.requires_grad_(name in keep)
    return model


def fuse_lora_(model: nn.Module, keep_base: bool = False) -> nn.Module:
    """Fuse every adapter into its base weight (generation); returns ``model``."""
    for layer in _lora_layers(model):
        layer.fuse_(keep_base)
    return model


def unfuse_lora_(model: nn.Module) -> nn.Module:
    """Undo :func:`fuse_lora_` (before training continues); returns ``model``."""
    for layer in _lora_layers(model):
        layer.unfuse_()
    return model


@contextmanager
def fused_lora(model: nn.Module, keep_base: bool = False) -> Iterator[nn.Module]:
    """``with fused_lora(model): model.generate(...)``: fused inside, unfused after."""
    fuse_lora_(model, keep_base)
    try:
        yield model
    finally:
        unfuse_lora_(model)


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter matrices only (a LoRA checkpoint is small: it omits the frozen base)."""
    return {name: p.detach().clone() for name, p in lora_parameters(model)}


def load_lora_state_dict(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Load a :func:`lora_state_dict` into a model converted with the same targets and rank.

    Raises:
        ValueError: missing or unexpected adapter names, or a shape mismatch (named).
        RuntimeError: the adapters are fused (unfuse first).
    """
    params = dict(lora_parameters(model))
    missing, extra = sorted(set(params) - set(state)), sorted(set(state) - set(params))
    if missing or extra:
        raise ValueError(
            f"load_lora_state_dict: adapter names differ (missing {missing[:6]}, unexpected "
            f"{extra[:6]}); convert the model with the same targets as the saved one"
        )
    if any(layer.fused for layer in _lora_layers(model)):
        raise RuntimeError("load_lora_state_dict: the adapters are fused; unfuse_lora_ first")
    for name, p in params.items():
        if state[name].shape != p.shape:
            raise ValueError(
                f"load_lora_state_dict: {name} has shape {tuple(state[name].shape)} in the "
                f"checkpoint but {tuple(p.shape)} in the model (a different rank?)"
            )
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(state[name])


# DeepSpeed-Chat's names (dschat/utils/module/lora.py).


def convert_linear_layer_to_lora(
    model: nn.Module,
    part_module_name: str | Sequence[str],
    lora_dim: int = 0,
    lora_scaling: float = 1.0,
    lora_droppout: float = 0.0,
) -> nn.Module:
    """DeepSpeed-Chat's conversion: ``scaling = lora_scaling / lora_dim`` (so ``lora_scaling``
    is ``alpha``), names matched as substrings. Returns ``model``."""
    targets = [part_module_name] if isinstance(part_module_name, str) else part_module_name
    apply_lora_(model, [re.escape(t) for t in targets], lora_dim, lora_scaling, lora_droppout)
    return model


def convert_lora_to_linear_layer(model: nn.Module) -> nn.Module:
    """DeepSpeed-Chat's name for fusing every adapter into its base weight."""
    return fuse_lora_(model)
