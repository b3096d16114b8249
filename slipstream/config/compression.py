"""``compression_training``: DeepSpeed's compression library config (DeepSpeed 0.19.8 key names
and defaults), used by ``slipstream.compression`` (``init_compression``, ``redundancy_clean``)
and by the engine, which advances the compression schedule on every applied optimizer step.

Each technique is ``{"shared_parameters": {...}, "different_groups": {name: {"params": {...},
"modules": [regex, ...], "related_modules": [[regex, ...], ...]}}}``; the shared parameters
hold the switch and the schedule, each group the per-module numbers. What slipstream does not
build is refused here, at parse time, by name and with the reason (``docs/compression.md``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from slipstream.config._base import StrictModel, check_keys
from slipstream.config._errors import ConfigError

__all__ = [
    "ActivationQuantizationConfig",
    "ChannelPruningConfig",
    "CompressionConfig",
    "HeadPruningConfig",
    "LayerReductionConfig",
    "RowPruningConfig",
    "SparsePruningConfig",
    "WeightQuantizationConfig",
]

QuantType = Literal["symmetric", "asymmetric"]
PruneMethod = Literal["l1", "topk"]


# ----------------------------------------------------------------------------- groups
class WeightQuantizationParams(StrictModel):
    """``weight_quantization.different_groups.<name>.params``."""

    start_bits: int = Field(ge=1)
    """Bits at the start of MoQ's schedule (``quantize_weight_in_forward`` false); the forward
    mode quantizes at ``target_bits`` from the start."""
    target_bits: int = Field(ge=1)
    """Bits of the quantized weights: >= 3 uniform (symmetric/asymmetric), 2 ternary, 1 binary."""
    quantization_period: int = Field(1, ge=0)
    """Steps between bit reductions of the MoQ schedule (unused by the forward mode)."""


class ActivationQuantizationParams(StrictModel):
    """``activation_quantization.different_groups.<name>.params``."""

    bits: Literal[4, 8]
    """Bits of the quantized layer inputs (DeepSpeed supports 4 and 8)."""


class PruningParams(StrictModel):
    """``*_pruning.different_groups.<name>.params``."""

    dense_ratio: float = Field(gt=0.0, le=1.0)
    """Fraction of weights (rows, heads, channels) kept."""


class _Group(StrictModel):
    modules: list[str]
    """Regular expressions searched (``re.search``) in module names; matching Linear, Conv2d,
    Embedding and BatchNorm2d modules form the group. A module may sit in one group per
    technique."""
    related_modules: list[list[str]] | None = None
    """Structured pruning: for the i-th entry of ``modules``, the modules whose input
    dimension shrinks with it when ``redundancy_clean`` removes the pruned rows/heads/channels."""


class WeightQuantizationGroup(_Group):
    params: WeightQuantizationParams
    """Bits of this group."""


class ActivationQuantizationGroup(_Group):
    params: ActivationQuantizationParams
    """Bits of this group."""


class PruningGroup(_Group):
    params: PruningParams
    """Dense ratio of this group."""


def _check_group_keys(value: Any, group_cls: type[StrictModel], where: str) -> Any:
    """Unknown keys inside a named group, with the full path and a did-you-mean."""
    if isinstance(value, dict):
        for name, group in value.items():
            check_keys(group, group_cls, f"compression_training.{where}.different_groups.{name}")
    return value


# ----------------------------------------------------------------------------- shared
class WeightQuantizationShared(StrictModel):
    """``weight_quantization.shared_parameters``."""

    enabled: bool = False
    """Quantize the weights of the groups' modules."""
    quantizer_kernel: bool = False
    """DeepSpeed's CUDA kernel for MoQ (refused there: nothing is compiled); no effect in the
    forward mode (as DeepSpeed)."""
    schedule_offset: int = Field(0, ge=0)
    """Optimizer steps before quantization starts."""
    quantize_groups: int = Field(1, ge=1)
    """Groups of the weight (rows split evenly) with one scale each (Embedding: one per row)."""
    quantize_verbose: bool = False
    """MoQ's per-step bit logging; no effect in the forward mode."""
    quantization_type: QuantType = "symmetric"
    """Symmetric (scale only) or asymmetric (scale and zero point) uniform quantization."""
    quantize_weight_in_forward: bool = False
    """True: every forward uses the quantized weight, gradients pass straight through to the
    full-precision weight. False: DeepSpeed's MoQ (fp16 only), which overwrites the fp16
    weights with their quantized values after each step (``slipstream.compression.moq``)."""
    rounding: Literal["nearest", "stochastic"] = "nearest"
    """MoQ rounding; the forward mode always rounds to nearest (as DeepSpeed)."""
    fp16_mixed_quantize: _FP16MixedQuantize = Field(default_factory=lambda: _FP16MixedQuantize())
    """MoQ's blend of fp16 and quantized weights; no effect in the forward mode."""


class _FP16MixedQuantize(StrictModel):
    enabled: bool = False
    """Blend fp16 and quantized weights (MoQ only)."""
    quantize_change_ratio: float = Field(0.001, ge=0.0)
    """Per-step change of the blend (MoQ only)."""


WeightQuantizationShared.model_rebuild()


class ActivationQuantizationShared(StrictModel):
    """``activation_quantization.shared_parameters``."""

    enabled: bool = False
    """Quantize the inputs of the groups' modules."""
    quantization_type: QuantType = "symmetric"
    """Symmetric or asymmetric."""
    range_calibration: Literal["dynamic", "static"] = "dynamic"
    """dynamic: a range per token (per sample for Conv2d) from the input itself; static: one
    range per module, a running min/max (momentum 0.95) updated in training, fixed in eval."""
    schedule_offset: int = Field(1000, ge=0)
    """Optimizer steps before quantization starts."""


class _PruningShared(StrictModel):
    enabled: bool = False
    """Prune the groups' modules."""
    schedule_offset: int = Field(1000, ge=0)
    """Optimizer steps before the mask applies."""


class SparsePruningShared(_PruningShared):
    """``sparse_pruning.shared_parameters``."""

    method: Literal["l1", "topk", "snip_momentum"] = "l1"
    """l1: keep the largest-magnitude weights (mask fixed at ``init_compression``); topk:
    learned scores; snip_momentum: Intel Neural Compressor's pruner (refused)."""
    schedule_offset_end: int | None = Field(None, ge=0)
    """Last step of the pruning window (snip_momentum)."""
    schedule_offset_stride: int = Field(1, ge=1)
    """Steps between pruning updates (snip_momentum)."""
    block_pattern: str = "4x1"
    """Block shape (snip_momentum)."""
    dense_ratio: float = Field(0.1, gt=0.0, lt=1.0)
    """Kept fraction (snip_momentum; the other methods take it per group)."""
    excluded_modules: list[str] = Field(default_factory=list)
    """Modules left dense (snip_momentum)."""


class RowPruningShared(_PruningShared):
    """``row_pruning.shared_parameters``."""

    method: PruneMethod = "l1"
    """l1: keep the rows (output features) with the largest L1 norm; topk: learned scores."""


class HeadPruningShared(_PruningShared):
    """``head_pruning.shared_parameters``."""

    method: PruneMethod = "topk"
    """topk (learned head scores); DeepSpeed implements no l1 head pruning."""
    num_heads: int | None = Field(None, ge=1)
    """Attention heads of the pruned output projection (required when enabled)."""


class ChannelPruningShared(_PruningShared):
    """``channel_pruning.shared_parameters``."""

    method: PruneMethod = "l1"
    """l1: keep the output channels of the largest L1 norm; topk: learned scores."""


# -------------------------------------------------------------------------- techniques
class _Technique(StrictModel):
    different_groups: dict[str, Any] | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.shared_parameters.enabled)  # type: ignore[attr-defined]

    @model_validator(mode="after")
    def _groups_when_enabled(self) -> _Technique:
        if self.enabled and self.different_groups is None and not self._groups_optional():
            raise ConfigError(
                f"config key 'compression_training.{self._key}.shared_parameters.enabled' is "
                f"true but '{self._key}.different_groups' is missing: add the groups "
                "({name: {params: {...}, modules: [...]}})"
            )
        return self

    _key = ""

    def _groups_optional(self) -> bool:
        return False


class WeightQuantizationConfig(_Technique):
    """``weight_quantization``."""

    _key = "weight_quantization"
    shared_parameters: WeightQuantizationShared = Field(default_factory=WeightQuantizationShared)
    """The switch, schedule and quantizer kind."""
    different_groups: dict[str, WeightQuantizationGroup] | None = None  # type: ignore[assignment]
    """Named module groups with their bits."""

    @field_validator("different_groups", mode="before")
    @classmethod
    def _keys(cls, value: Any) -> Any:
        return _check_group_keys(value, WeightQuantizationGroup, "weight_quantization")

    @model_validator(mode="after")
    def _low_bits_are_symmetric(self) -> WeightQuantizationConfig:
        if not self.enabled or self.shared_parameters.quantization_type == "symmetric":
            return self
        for name, group in (self.different_groups or {}).items():
            if group.params.target_bits <= 2:
                raise ConfigError(
                    "config key 'compression_training.weight_quantization.different_groups."
                    f"{name}.params.target_bits' = {group.params.target_bits}: ternary (2) and "
                    "binary (1) weights are symmetric only; set shared_parameters."
                    "quantization_type to symmetric or target_bits to 3 or more"
                )
        return self


class ActivationQuantizationConfig(_Technique):
    """``activation_quantization``."""

    _key = "activation_quantization"
    shared_parameters: ActivationQuantizationShared = Field(
        default_factory=ActivationQuantizationShared
    )
    """The switch, schedule, quantizer kind and range calibration."""
    different_groups: dict[str, ActivationQuantizationGroup] | None = None  # type: ignore[assignment]
    """Named module groups with their bits."""

    @field_validator("different_groups", mode="before")
    @classmethod
    def _keys(cls, value: Any) -> Any:
        return _check_group_keys(value, ActivationQuantizationGroup, "activation_quantization")


class SparsePruningConfig(_Technique):
    """``sparse_pruning``: unstructured weight masks."""

    _key = "sparse_pruning"
    shared_parameters: SparsePruningShared = Field(default_factory=SparsePruningShared)
    """The switch, schedule and method."""
    different_groups: dict[str, PruningGroup] | None = None  # type: ignore[assignment]
    """Named module groups with their dense ratio."""

    @field_validator("different_groups", mode="before")
    @classmethod
    def _keys(cls, value: Any) -> Any:
        return _check_group_keys(value, PruningGroup, "sparse_pruning")

    def _groups_optional(self) -> bool:
        return self.shared_parameters.method == "snip_momentum"


class RowPruningConfig(_Technique):
    """``row_pruning``: output features of Linear layers."""

    _key = "row_pruning"
    shared_parameters: RowPruningShared = Field(default_factory=RowPruningShared)
    """The switch, schedule and method."""
    different_groups: dict[str, PruningGroup] | None = None  # type: ignore[assignment]
    """Named module groups with their dense ratio."""

    @field_validator("different_groups", mode="before")
    @classmethod
    def _keys(cls, value: Any) -> Any:
        return _check_group_keys(value, PruningGroup, "row_pruning")


class HeadPruningConfig(_Technique):
    """``head_pruning``: attention heads, masked on the output projection."""

    _key = "head_pruning"
    shared_parameters: HeadPruningShared = Field(default_factory=HeadPruningShared)
    """The switch, schedule, method and head count."""
    different_groups: dict[str, PruningGroup] | None = None  # type: ignore[assignment]
    """Named module groups with their dense ratio."""

    @field_validator("different_groups", mode="before")
    @classmethod
    def _keys(cls, value: Any) -> Any:
        return _check_group_keys(value, PruningGroup, "head_pruning")

    @model_validator(mode="after")
    def _num_heads(self) -> HeadPruningConfig:
        if self.enabled and self.shared_parameters.num_heads is None:
            raise ConfigError(
                "config key 'compression_training.head_pruning.shared_parameters.num_heads' is "
                "missing: head pruning needs the attention head count of the pruned modules"
            )
        return self


class ChannelPruningConfig(_Technique):
    """``channel_pruning``: output channels of Conv2d layers."""

    _key = "channel_pruning"
    shared_parameters: ChannelPruningShared = Field(default_factory=ChannelPruningShared)
    """The switch, schedule and method."""
    different_groups: dict[str, PruningGroup] | None = None  # type: ignore[assignment]
    """Named module groups with their dense ratio."""

    @field_validator("different_groups", mode="before")
    @classmethod
    def _keys(cls, value: Any) -> Any:
        return _check_group_keys(value, PruningGroup, "channel_pruning")


class LayerReductionConfig(StrictModel):
    """``layer_reduction``: initialise a shallower student from chosen teacher layers (the
    set-up of ZeroQuant's layer-by-layer knowledge distillation, arXiv:2206.01861 sec. 4.3)."""

    enabled: bool = False
    """Copy the teacher's layers into the student at ``init_compression``."""
    keep_number_layer: int | None = Field(None, ge=1)
    """Layers of the student (the training script builds the student with this many; it must
    equal ``len(teacher_layer)``)."""
    module_name_prefix: str | None = None
    """Dotted path of the layer list, e.g. ``bert.encoder.layer`` or ``transformer.h``."""
    teacher_layer: list[int] | None = None
    """Teacher layer copied into student layer i, for i = 0, 1, ..."""
    other_module_name: list[str] = Field(default_factory=list)
    """Other modules copied whole from the teacher (embeddings, pooler, head)."""

    @model_validator(mode="after")
    def _complete(self) -> LayerReductionConfig:
        if not self.enabled:
            return self
        for key in ("module_name_prefix", "teacher_layer"):
            if getattr(self, key) is None:
                raise ConfigError(
                    f"config key 'compression_training.layer_reduction.{key}' is missing: "
                    "layer reduction needs module_name_prefix and teacher_layer"
                )
        assert self.teacher_layer is not None
        if self.keep_number_layer is not None and self.keep_number_layer != len(self.teacher_layer):
            raise ConfigError(
                "config key 'compression_training.layer_reduction.keep_number_layer' = "
                f"{self.keep_number_layer} differs from len(teacher_layer) = "
                f"{len(self.teacher_layer)}: student layer i is teacher layer teacher_layer[i], "
                "so give one teacher layer per kept layer"
            )
        return self


# Techniques or options slipstream parses but does not build, with the reason: refused when
# enabled, never dropped. The key is the dotted path under compression_training.
NOT_BUILT: dict[str, str] = {
    "sparse_pruning.shared_parameters.method": (
        "snip_momentum is Intel Neural Compressor's pruner, which DeepSpeed only wraps "
        "(pip neural-compressor); slipstream does not: use method l1 (magnitude mask) or "
        "topk (learned scores)"
    ),
    "head_pruning.shared_parameters.method": (
        "DeepSpeed prunes heads by learned scores only (its l1 head pruning raises "
        "NotImplementedError): set method to topk"
    ),
}


def _refused(cfg: CompressionConfig) -> list[tuple[str, str]]:
    """(dotted key, how it is set) for each key of ``cfg`` asking for something in
    ``NOT_BUILT``."""
    out = []
    sp = cfg.sparse_pruning
    if sp.enabled and sp.shared_parameters.method == "snip_momentum":
        out.append(("sparse_pruning.shared_parameters.method", "= 'snip_momentum'"))
    hp = cfg.head_pruning
    if hp.enabled and hp.shared_parameters.method == "l1":
        out.append(("head_pruning.shared_parameters.method", "= 'l1'"))
    return out


class CompressionConfig(StrictModel):
    """``compression_training``: DeepSpeed's compression techniques. A model is prepared by
    ``deepspeed.compression.compress.init_compression(model, config)``; the engine then turns
    each technique on at its ``schedule_offset`` (counted in applied optimizer steps)."""

    weight_quantization: WeightQuantizationConfig = Field(default_factory=WeightQuantizationConfig)
    """Quantization-aware training of weights."""
    activation_quantization: ActivationQuantizationConfig = Field(
        default_factory=ActivationQuantizationConfig
    )
    """Quantization of layer inputs."""
    sparse_pruning: SparsePruningConfig = Field(default_factory=SparsePruningConfig)
    """Unstructured pruning."""
    row_pruning: RowPruningConfig = Field(default_factory=RowPruningConfig)
    """Row (output feature) pruning."""
    head_pruning: HeadPruningConfig = Field(default_factory=HeadPruningConfig)
    """Attention-head pruning."""
    channel_pruning: ChannelPruningConfig = Field(default_factory=ChannelPruningConfig)
    """Conv2d channel pruning."""
    layer_reduction: LayerReductionConfig = Field(default_factory=LayerReductionConfig)
    """Student initialisation from teacher layers."""

    @property
    def enabled(self) -> bool:
        """Whether any technique acts during training (the engine drives the schedule)."""
        return any(t.enabled for t in self.techniques().values())

    def techniques(self) -> dict[str, _Technique]:
        """The scheduled techniques by key, in DeepSpeed's order."""
        return {
            "weight_quantization": self.weight_quantization,
            "activation_quantization": self.activation_quantization,
            "sparse_pruning": self.sparse_pruning,
            "row_pruning": self.row_pruning,
            "head_pruning": self.head_pruning,
            "channel_pruning": self.channel_pruning,
        }

    @model_validator(mode="after")
    def _refuse_unbuilt(self) -> CompressionConfig:
        refused = [
            f"config key 'compression_training.{key}' {how} cannot be honoured: {NOT_BUILT[key]}"
            for key, how in _refused(self)
        ]
        if refused:
            raise ConfigError(
                "; ".join(refused) + " (docs/compression.md lists what slipstream's "
                "compression library builds, and why the rest is refused)"
            )
        return self
