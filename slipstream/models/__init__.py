"""Reference models: a LLaMA-style decoder and a ViT segmenter (adaptive patching)."""

from slipstream.models.gpt import GPT, GPTConfig
from slipstream.models.vit import ViTSegConfig, ViTSegmenter

__all__ = ["GPT", "GPTConfig", "ViTSegConfig", "ViTSegmenter"]
