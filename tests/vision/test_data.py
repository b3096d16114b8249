"""Offline data helpers: synthetic exact-mask images, stain deconvolution, Otsu, tiling."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from slipstream.vision import (
    bundled_image,
    ihc_dab_mask,
    otsu_threshold,
    resize_square,
    rgb_to_hed,
    synthetic_blobs,
    tile,
)


def test_synthetic_blobs_are_deterministic_with_the_requested_coverage() -> None:
    """Same seed -> same images; mask covers ~volume_fraction; images in [0, 1]."""
    img, mask = synthetic_blobs(2, 128, seed=3, volume_fraction=0.3)
    img2, mask2 = synthetic_blobs(2, 128, seed=3, volume_fraction=0.3)
    assert (
        img.shape == (2, 3, 128, 128) and mask.shape == (2, 128, 128) and mask.dtype == torch.bool
    )
    assert torch.equal(img, img2) and torch.equal(mask, mask2)
    assert 0.2 < float(mask.float().mean()) < 0.4
    assert float(img.min()) >= 0 and float(img.max()) <= 1
    assert not torch.equal(mask, synthetic_blobs(2, 128, seed=4)[1])


def test_synthetic_scene_is_the_same_at_every_resolution() -> None:
    """The mask at 256 is the 512 mask seen at half resolution (one scene, more pixels)."""
    _, m256 = synthetic_blobs(1, 256, seed=0)
    _, m512 = synthetic_blobs(1, 512, seed=0)
    down = resize_square(m512[:, None].float(), 256, "area")[:, 0] > 0.5
    assert float((down == m256).float().mean()) > 0.99


def test_mask_edges_are_where_the_image_edges_are() -> None:
    """Canny on the synthetic image finds the mask boundary (the tree will refine there)."""
    from slipstream.vision import AdaptivePatcher

    img, mask = synthetic_blobs(1, 256, seed=1)
    edges = AdaptivePatcher().edges(img)
    boundary = mask ^ torch.nn.functional.max_pool2d(mask[:, None].float(), 3, 1, 1)[:, 0].bool()
    near = torch.nn.functional.max_pool2d(boundary[:, None].float(), 5, 1, 2)[:, 0].bool()
    assert float((edges & near).sum()) > 0.9 * float(edges.sum()) > 0


def test_rgb_to_hed_and_otsu_match_scikit_image() -> None:
    """Colour deconvolution equals skimage.color.rgb2hed; Otsu is within one bin of threshold_otsu."""
    color = pytest.importorskip("skimage.color")
    filters = pytest.importorskip("skimage.filters")
    rgb = bundled_image("immunohistochemistry")[:, :, :128, :128]
    ref = color.rgb2hed(rgb[0].permute(1, 2, 0).numpy())
    ours = rgb_to_hed(rgb)[0].permute(1, 2, 0).numpy()
    np.testing.assert_allclose(ours, ref, atol=1e-4)
    dab = rgb_to_hed(rgb)[:, 2]
    t = float(otsu_threshold(dab.flatten(1))[0])
    span = float(dab.max() - dab.min())
    assert abs(t - filters.threshold_otsu(dab[0].numpy())) <= span / 255 + 1e-6
    frac = float(ihc_dab_mask(rgb).float().mean())
    assert 0.02 < frac < 0.6


def test_bundled_images_tiles_and_resizing() -> None:
    """bundled_image -> (1, C, H, W) in [0, 1]; tile and resize_square give the stated shapes."""
    pytest.importorskip("skimage")
    coins = bundled_image("coins")
    assert coins.shape == (1, 1, 303, 384) and 0 <= float(coins.min()) < float(coins.max()) <= 1
    assert bundled_image("immunohistochemistry", 256).shape == (1, 3, 256, 256)
    assert tile(coins, 128).shape == (6, 1, 128, 128)
    assert resize_square(coins, 512).shape == (1, 1, 512, 512)
    with pytest.raises(ValueError, match="'kidney' is not an image bundled with scikit-image"):
        bundled_image("kidney")
    with pytest.raises(ValueError, match="tile_size=512 exceeds"):
        tile(coins, 512)
