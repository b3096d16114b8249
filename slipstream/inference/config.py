"""``init_inference``'s typed config: DeepSpeed's inference keys, validated at construction.

The key names are DeepSpeed-Inference's (``deepspeed.init_inference(model, config=...,
**kwargs)``), so configs written for DeepSpeed load unchanged. Keys that DeepSpeed has but
slipstream does not implement are refused with the reason, never dropped: a config that asks
for ZeRO-Inference or a custom injection policy would otherwise run something else silently.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field, field_validator, model_validator

from slipstream.config._base import StrictModel, validate_model
from slipstream.config._errors import ConfigError

__all__ = [
    "DTYPE_NAMES",
    "InferenceConfig",
    "InferenceTPConfig",
    "parse_dtype",
    "read_inference_config",
]

DTYPE_NAMES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "torch.float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "torch.float16": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "torch.bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "torch.int8": torch.int8,
}
"""Every dtype spelling DeepSpeed's inference config accepts, mapped to the torch dtype."""

# DeepSpeed keys slipstream refuses, with the reason and the fix.
_REFUSED: dict[str, str] = {
    "zero": "ZeRO-Inference (weights streamed from CPU/NVMe) is not implemented; load the "
    "model whole, or quantize it (quant=...) to fit",
    "injection_policy": "custom injection policies do not apply: slipstream generates with the "
    "model's own modules (replace_with_kernel_inject selects nothing else); remove the key",
    "injection_dict": "custom injection policies do not apply (see injection_policy); remove it",
    "injection_policy_tuple": "custom injection policies do not apply; remove the key",
    "save_mp_checkpoint_path": "saving a tensor-parallel sharded checkpoint at load time is "
    "not implemented; save with slipstream's checkpoint API instead",
}


_MOE_TYPES = ("standard", "residual")


def _check_moe_keys(base: dict[str, Any]) -> None:
    """DeepSpeed's MoE inference keys (``moe`` block, or the older top-level ``ep_size``,
    ``moe_experts``, ``moe_type``). slipstream generates with the model's own MoE layers
    (``slipstream.moe``), so the expert count and type come from the model, as in DeepSpeed
    without kernel injection. ``ep_size`` becomes ``moe_ep_size``; the others are removed."""
    moe = base.pop("moe", None)
    block = moe if isinstance(moe, dict) else {}
    if moe not in (None, True, False) and not isinstance(moe, dict):
        raise ConfigError(f"init_inference: config key 'moe' = {moe!r} must be a dict or a bool")
    ep = block.get("ep_size", base.pop("ep_size", None))
    if ep is not None and (not isinstance(ep, int) or isinstance(ep, bool) or ep < 1):
        raise ConfigError(
            f"init_inference: config key 'ep_size' = {ep!r} must be a positive integer"
        )
    if ep is not None:
        base["moe_ep_size"] = ep
    kind = block.get("type", base.pop("moe_type", None))
    if kind is not None and str(getattr(kind, "value", kind)) not in _MOE_TYPES:
        raise ConfigError(
            f"init_inference: config key 'moe_type' = {kind!r} must be 'standard' or 'residual'"
        )
    experts = block.get("moe_experts", base.pop("moe_experts", None))
    if experts is not None and not (
        isinstance(experts, list) and all(isinstance(e, int) and e >= 1 for e in experts)
    ):
        raise ConfigError(
            f"init_inference: config key 'moe_experts' = {experts!r} must be a list of "
            "positive expert counts"
        )
    unknown = sorted(set(block) - {"enabled", "ep_size", "type", "moe_experts"})
    if unknown:
        raise ConfigError(f"init_inference: unknown key(s) {unknown} in the 'moe' block")


def parse_dtype(value: Any, where: str = "dtype") -> torch.dtype:
    """A torch dtype from a torch dtype or any DeepSpeed spelling ("fp16", "torch.bfloat16")."""
    if isinstance(value, torch.dtype):
        if value in DTYPE_NAMES.values():
            return value
    elif isinstance(value, str) and value.lower() in DTYPE_NAMES:
        return DTYPE_NAMES[value.lower()]
    raise ConfigError(
        f"config key '{where}' = {value!r} is not a dtype slipstream can run inference in; "
        "use torch.float32 / 'fp32', torch.bfloat16 / 'bf16', torch.float16 / 'fp16' or "
        "'int8' (int8 weights through slipstream.quant)"
    )


class InferenceTPConfig(StrictModel):
    """``tensor_parallel`` (also ``tp``): split each layer over ``tp_size`` ranks."""

    enabled: bool = True
    """Use tensor parallelism when ``tp_size`` > 1."""
    tp_size: int = Field(1, ge=1)
    """Ranks per layer: the model is split with the training side's tensor parallelism
    (``slipstream.inference.parallel``); must divide the attention heads and the number of
    processes."""
    tp_group: Any = None
    """The process group of this rank's ``tp_size`` ranks (DeepSpeed name); default: the
    world when it has ``tp_size`` ranks, else groups of consecutive ranks."""
    mpu: Any = None
    """A Megatron-style model-parallel unit whose ``get_tensor_model_parallel_group()`` (or
    ``get_model_parallel_group()``) gives the group (DeepSpeed name)."""


class InferenceConfig(StrictModel):
    """DeepSpeed-Inference's config, as slipstream reads it.

    ``dtype`` and ``quant`` decide what the weights are; ``max_out_tokens`` bounds the
    prompt plus the generated tokens; ``tensor_parallel`` splits the model over
    ``tp_size`` processes.
    """

    dtype: Any = None
    """Weight and activation dtype (torch dtype or "fp32"/"bf16"/"fp16"/"int8"); None keeps
    the model's. "int8" means int8 weights through slipstream.quant (``quant`` picks how)."""
    tensor_parallel: InferenceTPConfig = Field(default_factory=InferenceTPConfig, alias="tp")
    """Tensor-parallel settings (also accepted as ``tp``)."""
    mp_size: int | None = Field(None, ge=1)
    """Deprecated DeepSpeed spelling of ``tensor_parallel.tp_size``."""
    replace_with_kernel_inject: bool = Field(False, alias="kernel_inject")
    """Accepted: DeepSpeed swaps in CUDA kernels; slipstream always runs its own generation
    path (the model's own modules, a KV cache, finished rows dropped from the batch), so
    true and false behave the same."""
    max_out_tokens: int = Field(1024, ge=1, alias="max_tokens")
    """Most tokens (prompt plus generated) one sequence may reach; longer requests are
    refused before any work starts. Also accepted as ``max_tokens``."""
    min_out_tokens: int = Field(1, ge=1)
    """Accepted for compatibility (DeepSpeed sizes kernel workspaces with it)."""
    checkpoint: str | dict[str, Any] | None = None
    """Weights to load into the model: a ``.safetensors`` file, a directory of them (an
    exported model, sharded or not), a ``.pt`` state dict, or a DeepSpeed checkpoint JSON
    description ``{"checkpoints": [files...]}``."""
    base_dir: str = ""
    """Directory that relative ``checkpoint`` paths are resolved against."""
    quant: Any = None
    """Quantization: a ``slipstream.quant`` config (``W8A8Int()``, ``W8A8FP8()``,
    ``W4A8Int4(lorc_rank=8)``, ...), a row name of ``slipstream.quant.eval.EVAL_CONFIGS``
    ("w8a8-int", "w4a8-int4-lorc8", ...), or DeepSpeed's dict ``{"enabled": true,
    "weight": {"num_bits": 8 | 4, "group_size": 64}}``."""
    enable_cuda_graph: bool = False
    """Capture the decode step of a Hugging Face causal LM on a CUDA device as one CUDA graph
    and replay it every step (``slipstream.inference.graphs``): a static KV cache, finished
    rows kept in the batch. Refused for the reference GPT, on the CPU and with
    ``tp_size`` > 1."""
    use_triton: Literal[False] = False
    """Accepted for compatibility; Triton kernels are not used (must be false)."""
    triangular_masking: bool = True
    """Accepted for compatibility (causal masking comes from the model)."""
    return_tuple: bool = True
    """Accepted for compatibility (outputs are the model's own)."""
    replace_method: str = "auto"
    """Accepted for compatibility (no module replacement happens)."""
    training_mp_size: int = Field(1, ge=1)
    """Tensor-parallel size the checkpoint was trained with (must be 1 for now)."""
    keep_module_on_host: bool = False
    """Accepted: the model stays on its device (CPU models stay on the CPU)."""
    kv_cache: Literal["auto", "paged", "dynamic", "static"] = "auto"
    """(slipstream) The KV cache ``generate`` decodes with: "paged" runs the request on the
    continuous-batching engine (paged KV cache; greedy requests of a model it drives, one
    process, refused otherwise with the reason), "dynamic" / "static" run the static loop on
    the transformers cache class of that name, "auto" is "paged" where it applies and
    "dynamic" elsewhere (``slipstream.inference.generation``). All give the same greedy
    tokens up to fp32 rounding; docs/inference.md has the timings behind the default."""
    cpu_half_gemm: Literal["auto", "native", "fp32"] = "auto"
    """(slipstream) How bf16/fp16 linear layers on the CPU multiply batches of rows: "fp32"
    computes them in fp32 from the half-precision weights (faster where the CPU has no
    bf16 instructions), "native" uses the bf16/fp16 GEMM, "auto" picks "fp32" unless the
    CPU has AVX512-BF16 or AMX (``slipstream.inference.kernels``)."""
    cpu_lm_head: Literal["packed", "native"] = "packed"
    """(slipstream) How the LM head multiplies on the CPU: "packed" keeps fp32 copies of its
    weight in the layouts the CPU GEMM kernels run fastest (one per row-count class, built
    on first use: more memory, the head's size in fp32 each), "native" uses the module as
    it is (``slipstream.inference.kernels``)."""
    moe_ep_size: int = Field(1, ge=1)
    """Expert-parallel ranks for MoE models (DeepSpeed's ``moe.ep_size`` or ``ep_size``): each
    rank holds ``1/moe_ep_size`` of every MoE layer's experts (``slipstream.inference.experts``).
    """
    finished_rows: Literal["drop", "mask"] = "drop"
    """(slipstream) What happens to a sequence that has ended while others go on: "drop"
    removes it from the batch and the cache (it stops costing compute), "mask" keeps
    feeding it the pad token as Hugging Face ``generate`` does."""

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype(cls, value: Any) -> Any:
        return None if value is None else parse_dtype(value)

    @model_validator(mode="after")
    def _merge_mp_size(self) -> InferenceConfig:
        if self.mp_size is not None:
            tp = self.tensor_parallel.tp_size
            if tp not in (1, self.mp_size):
                raise ConfigError(
                    f"init_inference: mp_size={self.mp_size} contradicts "
                    f"tensor_parallel.tp_size={tp}; set only tensor_parallel.tp_size "
                    "(mp_size is its deprecated name)"
                )
            object.__setattr__(
                self, "tensor_parallel", InferenceTPConfig(
                    enabled=self.tensor_parallel.enabled, tp_size=self.mp_size,
                    tp_group=self.tensor_parallel.tp_group, mpu=self.tensor_parallel.mpu,
                )
            )  # fmt: skip
        return self

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """The float dtype the weights run in (None: keep the model's; int8 runs in fp32)."""
        if self.dtype is torch.int8:
            return torch.float32
        return self.dtype

    @property
    def tp_size(self) -> int:
        """The effective tensor-parallel size (1 when disabled)."""
        return self.tensor_parallel.tp_size if self.tensor_parallel.enabled else 1


def read_inference_config(config: Any, kwargs: dict[str, Any]) -> InferenceConfig:
    """``config`` (dict, ``InferenceConfig`` or None) merged with ``kwargs``, validated.

    Raises:
        ConfigError: a key is unknown (with a did-you-mean), has a bad value, is refused, or
            is given in both ``config`` and ``kwargs`` with different values (DeepSpeed
            raises there too).
    """
    if isinstance(config, InferenceConfig):
        base: dict[str, Any] = config.model_dump(exclude_unset=True)
    elif config is None:
        base = {}
    elif isinstance(config, dict):
        base = dict(config)
    else:
        raise ConfigError(
            f"init_inference: config must be a dict or InferenceConfig, got "
            f"{type(config).__name__}; pass the keys as a dict or as keyword arguments"
        )
    for key, value in kwargs.items():
        if key in base and base[key] != value:
            raise ConfigError(
                f"init_inference: key '{key}' is {base[key]!r} in config and {value!r} in "
                "the keyword arguments; give it once"
            )
        base[key] = value
    if base.get("dtype") is not None:
        base["dtype"] = parse_dtype(base["dtype"])
    _check_moe_keys(base)
    for key, why in _REFUSED.items():
        value = base.pop(key, None)
        neutral: tuple[Any, ...] = (None, 1) if key == "ep_size" else (None, {}, False)
        if value not in neutral:
            raise ConfigError(f"init_inference: config key '{key}' = {value!r}: {why}")
    return validate_model(InferenceConfig, base, "")
