"""Reference models: a LLaMA-style decoder and a ViT segmenter (adaptive patching), and LoRA."""

from slipstream.models.gpt import GPT, GPTConfig, GPTMoEConfig
from slipstream.models.lora import (
    LoRALinear,
    apply_lora_,
    convert_linear_layer_to_lora,
    convert_lora_to_linear_layer,
    fuse_lora_,
    fused_lora,
    load_lora_state_dict,
    lora_state_dict,
    only_optimize_lora_parameters,
    unfuse_lora_,
)
from slipstream.models.vit import ViTSegConfig, ViTSegmenter

__all__ = [
    "GPT",
    "GPTConfig",
    "GPTMoEConfig",
    "LoRALinear",
    "ViTSegConfig",
    "ViTSegmenter",
    "apply_lora_",
    "convert_linear_layer_to_lora",
    "convert_lora_to_linear_layer",
    "fuse_lora_",
    "fused_lora",
    "load_lora_state_dict",
    "lora_state_dict",
    "only_optimize_lora_parameters",
    "unfuse_lora_",
]
