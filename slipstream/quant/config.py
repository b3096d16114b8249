"""Typed configurations of :func:`slipstream.quant.quantize_`, one dataclass per scheme.

Each config is validated at construction; the error names the field, the bad value, the
constraint and the fix. ``skip`` holds ``fnmatch`` patterns of module names left in float.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from slipstream.config._errors import ConfigError

__all__ = [
    "HERO_PRESETS",
    "W4A8FP4",
    "W8A8FP8",
    "HeroModes",
    "QuantConfig",
    "W4A8Int4",
    "W8A8Int",
    "hero_preset",
]

LORC_PAPER_RANK = 8
"""The LoRC rank of ZeroQuant-V2/FP (spec sec. 2.2); configs default to 0 (off)."""

# Module-name suffixes of each GEMM role, for Llama/slipstream GPT, BERT and GPT-2 names.
_ROLE_PATTERNS: dict[str, str] = {
    "qkv_gemm": r"(q_proj|k_proj|v_proj|query|key|value|c_attn)$",
    "attn_out_gemm": r"(o_proj|attention\.output\.dense|attn\.c_proj|out_proj)$",
    "fc1_gemm": r"(gate_proj|up_proj|intermediate\.dense|c_fc|fc1)$",
    "fc2_gemm": r"(down_proj|(?<!attention\.)output\.dense|mlp\.c_proj|fc2)$",
}


@dataclass(frozen=True)
class HeroModes:
    """ZeroQuant-HERO's per-module INT8 / float switch (True = run this GEMM in INT8).

    The paper's M1/M2/M3 tables were not available to us (spec sec. 1.2, UNCONFIRMED), so
    presets in :data:`HERO_PRESETS` are named by what they do and were chosen by measurement
    (docs/quantization.md). A GEMM switched off stays an ``nn.Linear`` in the model's dtype;
    an attention core switched off stays the model's float attention.
    """

    qkv_gemm: bool = True
    """Query/key/value projections."""
    attn_core: bool = True
    """QK^T and PV as int8 x int8 -> int32 products, softmax quantized at the fixed scale
    1/127 (:mod:`slipstream.quant.attention`; slipstream GPT attention only)."""
    attn_out_gemm: bool = True
    """Attention output projection."""
    fc1_gemm: bool = True
    """First MLP GEMM(s) (up/gate)."""
    fc2_gemm: bool = True
    """Second MLP GEMM (down); its input (after GeLU/SwiGLU) is the most skewed."""

    def role_of(self, name: str) -> str | None:
        """The role whose name pattern matches module ``name``, or None."""
        for role, pat in _ROLE_PATTERNS.items():
            if re.search(pat, name):
                return role
        return None

    def allows(self, name: str) -> bool:
        """Whether module ``name`` should be quantized under these modes."""
        role = self.role_of(name)
        return True if role is None else bool(getattr(self, role))


HERO_PRESETS: dict[str, HeroModes] = {
    "all_int8": HeroModes(),
    "attn_core_float": HeroModes(attn_core=False),
    "fc2_float": HeroModes(fc2_gemm=False),
    "mlp_float": HeroModes(fc1_gemm=False, fc2_gemm=False),
    "attn_int8_only": HeroModes(fc1_gemm=False, fc2_gemm=False, attn_out_gemm=False),
}
"""Named switch sets, from most to least INT8."""


def hero_preset(name: str) -> HeroModes:
    """The :class:`HeroModes` preset ``name``. Raises ConfigError listing valid names."""
    if name not in HERO_PRESETS:
        raise ConfigError(
            f"unknown HERO preset {name!r}; valid presets are: {', '.join(HERO_PRESETS)}"
        )
    return HERO_PRESETS[name]


def _check_choice(cls: str, fname: str, value: object, choices: tuple[object, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{cls}.{fname}={value!r} is invalid; choose one of {list(choices)}")


@dataclass(frozen=True)
class QuantConfig:
    """Fields shared by every scheme."""

    lorc_rank: int = 0
    """Rank of the LoRC low-rank error compensation (0 = off; the papers use 8)."""
    skip: tuple[str, ...] = ("lm_head",)
    """fnmatch patterns of module names to leave in float (default: the LM head)."""

    def __post_init__(self) -> None:
        name = type(self).__name__
        if not isinstance(self.lorc_rank, int) or self.lorc_rank < 0:
            raise ConfigError(
                f"{name}.lorc_rank={self.lorc_rank!r} must be an int >= 0; use 0 to disable "
                f"LoRC or {LORC_PAPER_RANK} as in the paper"
            )
        if isinstance(self.skip, str):
            raise ConfigError(
                f"{name}.skip={self.skip!r} must be a tuple of patterns, not a string; "
                f"write skip=({self.skip!r},)"
            )

    def allows(self, name: str) -> bool:
        """Whether module ``name`` is quantized (not skipped, allowed by any mode switch)."""
        from fnmatch import fnmatch

        return not any(fnmatch(name, pat) for pat in self.skip)


@dataclass(frozen=True)
class W8A8Int(QuantConfig):
    """ZeroQuant-HERO W8A8: int8 per-channel weights, int8 activations, integer GEMMs."""

    act_scheme: Literal["token", "tensor"] = "token"
    """``"token"``: dynamic per-token scales (R1); ``"tensor"``: static per-tensor scale
    from :func:`~slipstream.quant.calibrate` (clamps outliers beyond the calibrated range)."""
    backend: Literal["int_mm", "fbgemm"] = "int_mm"
    """``"int_mm"``: ``torch._int_mm``, exact W8A8 on CPU and CUDA. ``"fbgemm"``: the x86
    FBGEMM int8 kernel (CPU only, fast), which needs 7-bit weights (W7A8) to stay exact."""
    fuse_norms: bool = True
    """Quantize per-token in the epilogue of each LayerNorm/RMSNorm and hand the int8 rows to
    the GEMMs that consume that norm's output (quantize once instead of once per GEMM)."""
    modes: HeroModes = field(default_factory=HeroModes)
    """Per-module INT8/float switch."""
    attn_scales: Literal["dynamic", "static"] = "dynamic"
    """Scales of the INT8 attention core (``modes.attn_core``): ``"dynamic"`` per-token Q/K and
    per-feature V computed each forward; ``"static"`` per-head Q/K and per-(head, feature) V
    recorded by :func:`~slipstream.quant.calibrate` (the spec's plan; needs calibration)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_choice("W8A8Int", "act_scheme", self.act_scheme, ("token", "tensor"))
        _check_choice("W8A8Int", "backend", self.backend, ("int_mm", "fbgemm"))
        _check_choice("W8A8Int", "attn_scales", self.attn_scales, ("dynamic", "static"))

    def allows(self, name: str) -> bool:
        return super().allows(name) and self.modes.allows(name)


@dataclass(frozen=True)
class W8A8FP8(QuantConfig):
    """ZeroQuant-FP W8A8: E4M3 per-channel weights, FP8 per-token activations."""

    act_format: Literal["e4m3", "e5m2"] = "e4m3"
    """Activation format (E4M3: more mantissa; E5M2: more range)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_choice("W8A8FP8", "act_format", self.act_format, ("e4m3", "e5m2"))


@dataclass(frozen=True)
class _W4A8(QuantConfig):
    group_size: int = 64
    """Input features per weight scale group (must divide in_features)."""
    constraint: Literal["pow2", "row_pow2"] = "row_pow2"
    """Scale constraint making the 4-bit -> 8-bit conversion exact: ``"pow2"`` (M1) or
    ``"row_pow2"`` (M2, real row scale x power-of-two group ratios)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        name = type(self).__name__
        if not isinstance(self.group_size, int) or self.group_size < 2 or self.group_size % 2:
            raise ConfigError(
                f"{name}.group_size={self.group_size!r} must be an even int >= 2, e.g. 64 or 128"
            )
        _check_choice(name, "constraint", self.constraint, ("pow2", "row_pow2"))


@dataclass(frozen=True)
class W4A8Int4(_W4A8):
    """INT4 group-wise weights expanded exactly to int8, int8 per-token activations."""

    backend: Literal["int_mm", "fbgemm"] = "int_mm"
    """Integer GEMM backend (see :class:`W8A8Int`); the INT4 grid is the same for both."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_choice("W4A8Int4", "backend", self.backend, ("int_mm", "fbgemm"))


@dataclass(frozen=True)
class W4A8FP4(_W4A8):
    """ZeroQuant-FP W4A8: FP4 E2M1 group-wise weights, exact shift to E4M3, FP8 activations."""

    act_format: Literal["e4m3", "e5m2"] = "e4m3"
    """Activation format."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_choice("W4A8FP4", "act_format", self.act_format, ("e4m3", "e5m2"))
