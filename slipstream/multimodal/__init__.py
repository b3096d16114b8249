"""DeepSpeed-VisualChat (Yao et al. 2023, arXiv 2309.14327): multi-modal causal attention
(MMCA), a vision-language chat model over a frozen vision encoder and a frozen causal LM,
interleaved multi-image conversations and their data blending. See docs/visualchat.md."""

from slipstream.multimodal.attention import IMAGE, PAD, TEXT, MMCAMode, mmca_attention
from slipstream.multimodal.lm import (
    ExtendedEmbedding,
    MMCACore,
    TokenTypes,
    register_hf_mmca,
    use_mmca_,
)
from slipstream.multimodal.model import Assembled, VisionEncoder, VisualChat, VisualChatConfig

__all__ = [
    "IMAGE",
    "PAD",
    "TEXT",
    "Assembled",
    "ExtendedEmbedding",
    "MMCACore",
    "MMCAMode",
    "TokenTypes",
    "VisionEncoder",
    "VisualChat",
    "VisualChatConfig",
    "mmca_attention",
    "register_hf_mmca",
    "use_mmca_",
]
