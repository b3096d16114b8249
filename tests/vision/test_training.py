"""Adaptive vs uniform training helpers on the slipstream engine (tiny, a few steps)."""

from __future__ import annotations

import torch

from slipstream.models.vit import ViTSegConfig, ViTSegmenter
from slipstream.vision import (
    AdaptivePatcher,
    APFConfig,
    evaluate_dice,
    synthetic_blobs,
    tokenize,
    train_segmenter,
)


def test_tokenize_train_and_evaluate_through_the_engine() -> None:
    """tokenize -> train_segmenter (slipstream.initialize) lowers the loss; Dice is in [0, 1]."""
    images, masks = synthetic_blobs(6, 128, seed=0)
    patcher = AdaptivePatcher(APFConfig(patch_size=4, length=64))
    adaptive = tokenize(patcher, images, masks, chunk=4)
    uniform = tokenize(patcher, images, masks, uniform=True)
    assert adaptive.batch.tokens.shape == uniform.batch.tokens.shape == (6, 64, 3, 4, 4)
    assert not torch.equal(adaptive.batch.leaves.size, uniform.batch.leaves.size)
    torch.manual_seed(0)
    model = ViTSegmenter(ViTSegConfig.preset("tiny", patch_size=4, max_tokens=64))
    before = evaluate_dice(model, adaptive)
    result = train_segmenter(model, adaptive, steps=12, batch_size=3, lr=3e-3)
    assert len(result.step_s) == 12 and result.median_step_s > 0
    assert sum(result.losses[-3:]) < sum(result.losses[:3])
    after = evaluate_dice(model, adaptive)
    assert 0.0 <= before <= 1.0 and after > before


def test_data_parallel_training_matches_one_process_on_the_global_batch() -> None:
    """2 gloo ranks with ZeRO-2 end with the parameters of 1 process on the same global batches."""
    from tests.distributed.harness import run_world
    from tests.vision._dp_workload import train_tiny

    ranks = run_world(train_tiny, 2, 2)
    single = train_tiny(0)
    torch.manual_seed(0)
    init = ViTSegmenter(ViTSegConfig.preset("tiny", patch_size=4, max_tokens=64)).state_dict()
    assert not torch.equal(single["patch_embed.weight"], init["patch_embed.weight"])
    for name, ref in single.items():
        for got in ranks:
            torch.testing.assert_close(got[name], ref, rtol=1e-4, atol=2e-5, msg=name)
