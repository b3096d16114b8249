"""The APF front end: pure-preprocessing equivalence, masks on the same tree, config errors."""

from __future__ import annotations

import pytest
import torch

from slipstream.config._errors import ConfigError
from slipstream.models.vit import ViTSegConfig, ViTSegmenter
from slipstream.vision import (
    AdaptivePatcher,
    APFConfig,
    dice_score,
    extract_tokens,
    patchify,
    uniform_leaves,
)


@pytest.mark.parametrize("position", ["slot", "slot+geometry"])
def test_all_edge_map_makes_apf_identical_to_the_uniform_patch_vit(position: str) -> None:
    """Spec 1.5: all-edge map, L = 4**k, P = R / 2**k -> same tokens and bit-identical model output."""
    torch.manual_seed(0)
    images = torch.rand(2, 3, 64, 64)
    patcher = AdaptivePatcher(APFConfig(patch_size=16, length=16))
    batch = patcher(images, edges=torch.ones(2, 64, 64, dtype=torch.bool))
    uniform = patchify(images, 16, "morton")
    assert torch.equal(batch.tokens, uniform) and batch.valid.all()
    model = ViTSegmenter(
        ViTSegConfig.preset("tiny", patch_size=16, max_tokens=16, position=position)
    )
    grid = AdaptivePatcher(APFConfig(patch_size=16, length=16)).tokens(
        images, uniform_leaves(2, 64, 16)
    )
    out_apf = model(batch.tokens, batch.valid, batch.geometry)
    out_uni = model(uniform, None, grid.geometry)
    assert torch.equal(out_apf, out_uni)


def test_masks_go_through_the_same_tree_as_images() -> None:
    """Targets are the mask resized over the image's leaves; painting them back recovers the mask."""
    torch.manual_seed(1)
    mask = torch.zeros(1, 64, 64, dtype=torch.bool)
    mask[:, 10:40, 20:50] = True
    images = mask[:, None].float().expand(1, 3, 64, 64) * 0.8 + 0.1
    patcher = AdaptivePatcher(APFConfig(patch_size=4, length=64, min_size=2))
    batch = patcher(images, mask)
    assert batch.targets is not None and batch.targets.shape == (1, 64, 4, 4)
    ref = extract_tokens(mask[:, None].float(), batch.leaves, 4)[:, :, 0]
    assert torch.equal(batch.targets, ref)
    assert float(dice_score(batch.to_image(batch.targets) > 0.5, mask)[0]) > 0.97
    # The edges follow the rectangle, so leaves there are small and flat areas get big leaves.
    sizes = batch.leaves.size[batch.valid]
    assert int(sizes.min()) <= 4 and int(sizes.max()) >= 16


def test_geometry_holds_centres_and_depths() -> None:
    """PatchBatch.geometry = (centre row / R, centre col / R, log2(R / s)); -1 centre at padding."""
    images = torch.zeros(1, 1, 32, 32)
    batch = AdaptivePatcher(APFConfig(patch_size=4, length=7)).tokens(
        images, uniform_leaves(1, 32, 16)
    )
    g = batch.geometry
    assert g.shape == (1, 4, 3)
    assert torch.allclose(g[0, 1], torch.tensor([0.25, 0.75, 1.0]))


def test_uniform_baseline_uses_the_same_budget_and_patch_size() -> None:
    """patcher.uniform: L = 4**k leaves of side R / 2**k, each resized to P x P."""
    images, masks = torch.rand(2, 3, 128, 128), torch.rand(2, 128, 128) > 0.5
    batch = AdaptivePatcher(APFConfig(patch_size=8, length=256)).uniform(images, masks)
    assert batch.tokens.shape == (2, 256, 3, 8, 8)
    assert (batch.leaves.size == 8).all()
    with pytest.raises(ValueError, match="power of 4"):
        AdaptivePatcher(APFConfig(patch_size=8, length=256)).uniform(images, masks, length=100)


def test_apf_uses_far_fewer_tokens_than_uniform_patches_on_the_ihc_slide() -> None:
    """Spec 1.5 cost check: threshold APF on the 512^2 IHC slide needs < 1/10 of the 16,384 4x4 patches."""
    pytest.importorskip("skimage")
    from slipstream.vision import bundled_image

    patcher = AdaptivePatcher(APFConfig(variant="threshold", length=None, patch_size=4))
    batch = patcher(bundled_image("immunohistochemistry", 512))
    n = int(batch.leaves.num_leaves[0])
    assert 100 < n < 16_384 / 10


def test_config_and_input_errors_name_the_field_and_fix() -> None:
    """Bad config fields and bad image/mask shapes raise with the offending value."""
    with pytest.raises(ConfigError, match=r"length=576 must be 1 mod 3"):
        APFConfig(length=576)
    with pytest.raises(ConfigError, match="patch_size=6 must be a power of two"):
        APFConfig(patch_size=6)
    with pytest.raises(ConfigError, match="blur_kernel=4"):
        APFConfig(blur_kernel=4)
    with pytest.raises(ConfigError, match="canny_low=300"):
        APFConfig(canny_low=300)
    with pytest.raises(ConfigError, match=r"unknown APFConfig field\(s\) \['lenght'\]"):
        AdaptivePatcher(lenght=64)
    patcher = AdaptivePatcher(length=64)
    with pytest.raises(ValueError, match="R=48 must be a power of two"):
        patcher(torch.rand(1, 3, 48, 48))
    with pytest.raises(ValueError, match=r"masks must have shape \(batch, R, R\)"):
        patcher(torch.rand(1, 3, 64, 64), torch.zeros(1, 32, 32))


def test_uint8_images_match_their_float_version() -> None:
    """A uint8 image (0-255) gives the tree and tokens of the same image as floats in [0, 1]."""
    from slipstream.vision import synthetic_blobs

    images, masks = synthetic_blobs(2, 128, seed=3)
    u8 = (images * 255).round().to(torch.uint8)
    patcher = AdaptivePatcher(APFConfig(patch_size=8, length=64))
    a, b = patcher(u8, masks), patcher(u8.float() / 255, masks)
    assert torch.equal(a.leaves.size, b.leaves.size) and torch.equal(a.leaves.y, b.leaves.y)
    assert a.tokens.dtype == torch.float32
    torch.testing.assert_close(a.tokens, b.tokens, rtol=0, atol=1e-6)
    assert a.targets is not None and b.targets is not None
    assert torch.equal(a.targets, b.targets)
    with pytest.raises(ValueError, match=r"float in \[0, 1\] or uint8.*int16"):
        patcher(u8.to(torch.int16), masks)


def test_cpu_patcher_pools_tokens_in_the_edge_pass_with_the_same_result() -> None:
    """numba backend (edges and the tokens' first level in one pass) == torch backend."""
    pytest.importorskip("numba")
    from slipstream.vision import synthetic_blobs

    images, masks = synthetic_blobs(2, 256, seed=4)
    u8 = (images * 255).round().to(torch.uint8)
    fused = AdaptivePatcher(APFConfig(patch_size=8, length=256))
    plain = AdaptivePatcher(APFConfig(patch_size=8, length=256, backend="torch"))
    assert fused._fused_factor(u8) == 8 and plain._fused_factor(u8) == 0
    assert fused._fused_factor(images.double()) == 0
    for x in (u8, images):
        a, b = fused(x, masks), plain(x, masks)
        assert torch.equal(a.leaves.size, b.leaves.size) and torch.equal(a.leaves.x, b.leaves.x)
        assert a.targets is not None and b.targets is not None
        assert torch.equal(a.targets, b.targets)
        if x.dtype == torch.uint8:
            assert torch.equal(a.tokens, b.tokens)
        else:
            torch.testing.assert_close(a.tokens, b.tokens, rtol=1e-6, atol=1e-6)
    sizes = fused(u8).leaves.size
    assert bool((sizes < 64).any()) and bool((sizes >= 64).any())  # both token paths used
