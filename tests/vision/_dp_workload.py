"""Rank body of the data-parallel parity test (importable by spawned ranks)."""

from __future__ import annotations

import torch

from slipstream.models.vit import ViTSegConfig, ViTSegmenter
from slipstream.vision import AdaptivePatcher, APFConfig, synthetic_blobs, tokenize, train_segmenter


def train_tiny(stage: int) -> dict[str, torch.Tensor]:
    """Three steps of a tiny segmenter on adaptive tokens; returns the final parameters."""
    images, masks = synthetic_blobs(8, 64, seed=0)
    data = tokenize(AdaptivePatcher(APFConfig(patch_size=4, length=64)), images, masks)
    torch.manual_seed(0)
    model = ViTSegmenter(ViTSegConfig.preset("tiny", patch_size=4, max_tokens=64))
    config = {
        "train_batch_size": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage},
    }
    train_segmenter(model, data, steps=3, batch_size=4, config=config)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
