"""Leaves <-> tokens: resize semantics, the inverse, and the horse-mask round trip."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slipstream.vision import (
    AdaptivePatcher,
    APFConfig,
    dice_score,
    extract_tokens,
    fixed_length_quadtree,
    patchify,
    threshold_quadtree,
    tokens_to_image,
    uniform_leaves,
)


def _mixed_leaves(r: int = 64) -> tuple[torch.Tensor, object]:
    g = torch.Generator().manual_seed(0)
    e = torch.rand(2, r, r, generator=g) < 0.04
    e[:, :8, :8] = True  # forces leaves of side 2 and 4 (smaller than P = 4 / 8)
    return torch.rand(2, 3, r, r, generator=g), fixed_length_quadtree(e, 40, min_size=2)


@pytest.mark.parametrize("p", [4, 8])
def test_area_tokens_are_box_filtered_crops_and_small_leaves_replicate(p: int) -> None:
    """Each token equals the area-resized crop of its leaf (nearest upsampling when s < P)."""
    images, leaves = _mixed_leaves()
    tokens = extract_tokens(images, leaves, p, "area")
    assert tokens.shape == (2, 40, 3, p, p)
    sizes = set()
    for b in range(2):
        for i in range(leaves.length):
            if not leaves.valid[b, i]:
                assert not tokens[b, i].any(), "padding tokens are zero"
                continue
            y, x, s = (int(t[b, i]) for t in (leaves.y, leaves.x, leaves.size))
            sizes.add(s)
            crop = images[b : b + 1, :, y : y + s, x : x + s]
            mode = "area" if s >= p else "nearest"
            ref = F.interpolate(crop, size=(p, p), mode=mode)[0]
            torch.testing.assert_close(tokens[b, i], ref, rtol=1e-5, atol=1e-6)
    assert min(sizes) < p < max(sizes)


def test_area_tokens_of_large_leaves_and_bool_masks() -> None:
    """Leaves all >= 2P start the pyramid below full resolution; bool masks pool as floats."""
    g = torch.Generator().manual_seed(1)
    e = torch.rand(2, 128, 128, generator=g) < 0.01
    leaves = fixed_length_quadtree(e, 22, min_size=16)
    images = torch.rand(2, 3, 128, 128, generator=g)
    masks = torch.rand(2, 1, 128, 128, generator=g) > 0.5
    for x in (images, masks):
        tokens = extract_tokens(x, leaves, 4, "area")
        assert tokens.dtype == torch.float32
        for b in range(2):
            for i in range(int(leaves.num_leaves[b])):
                y, xx, s = (int(t[b, i]) for t in (leaves.y, leaves.x, leaves.size))
                crop = x[b : b + 1, :, y : y + s, xx : xx + s].float()
                ref = F.interpolate(crop, size=(4, 4), mode="area")[0]
                torch.testing.assert_close(tokens[b, i], ref, rtol=1e-5, atol=1e-6)


def test_nearest_tokens_sample_the_pixel_under_each_token_pixel_centre() -> None:
    """mode='nearest' picks pixel y + floor((i + 0.5) * s / P) of each leaf."""
    images, leaves = _mixed_leaves()
    tokens = extract_tokens(images, leaves, 4, "nearest")
    b, i = 0, int(leaves.size[0].argmax())
    y, x, s = (int(t[b, i]) for t in (leaves.y, leaves.x, leaves.size))
    idx = torch.tensor([int((k + 0.5) * s / 4) for k in range(4)])
    assert torch.equal(tokens[b, i], images[b, :, y + idx][:, :, x + idx])


def test_inverse_is_exact_when_no_leaf_exceeds_the_patch_size() -> None:
    """Round trip image -> tokens -> image is exact for leaves <= P (and for the uniform grid)."""
    images, _ = _mixed_leaves(32)
    small = fixed_length_quadtree(torch.ones(2, 32, 32, dtype=torch.bool), 256, min_size=2)
    for lv, p in ((small, 4), (small, 2), (uniform_leaves(2, 32, 8), 8)):
        assert torch.equal(tokens_to_image(extract_tokens(images, lv, p), lv), images)
    mask = images[:, 0] > 0.5
    big = fixed_length_quadtree(torch.ones(2, 32, 32, dtype=torch.bool), 64)
    back = tokens_to_image(extract_tokens(mask[:, None].float(), big, 8)[:, :, 0], big)
    assert torch.equal(back > 0.5, mask)


def test_inverse_fills_pixels_of_dropped_leaves() -> None:
    """Pixels whose leaf was dropped (threshold variant over length) get the fill value."""
    e = torch.rand(1, 32, 32, generator=torch.Generator().manual_seed(1)) < 0.2
    leaves = threshold_quadtree(e, 2, length=10, generator=torch.Generator().manual_seed(0))
    out = tokens_to_image(torch.ones(1, 10, 4, 4), leaves, fill=-1.0)
    covered = int((leaves.size[leaves.valid] ** 2).sum())
    assert int((out == 1).sum()) == covered and int((out == -1).sum()) == 32 * 32 - covered


def test_patchify_orders_and_errors() -> None:
    """Raster order is the usual ViT unfold; Morton order is a permutation of it."""
    x = torch.arange(2 * 16 * 16, dtype=torch.float32).view(2, 1, 16, 16)
    raster = patchify(x, 4, "raster")
    assert torch.equal(raster[0, 1, 0], x[0, 0, 0:4, 4:8])
    morton = patchify(x, 4)
    assert torch.equal(morton[0, 2], raster[0, 4]) and torch.equal(morton[0, 1], raster[0, 1])
    with pytest.raises(ValueError, match="do not split into 3 x 3"):
        patchify(x, 3)


def test_horse_mask_round_trip_dice_at_1024_tokens() -> None:
    """Spec 1.5: the horse silhouette (512^2) through a 1024-token tree and back keeps Dice >= 0.998."""
    pytest.importorskip("skimage")
    from slipstream.vision import horse_mask

    mask = horse_mask(512)
    patcher = AdaptivePatcher(APFConfig(patch_size=8, length=1024))
    batch = patcher(mask[:, None].float(), mask)
    assert batch.targets is not None
    dice = float(dice_score(batch.to_image(batch.targets) > 0.5, mask)[0])
    assert dice >= 0.998
    small = AdaptivePatcher(APFConfig(patch_size=8, length=64))(mask[:, None].float(), mask)
    assert small.targets is not None
    assert float(dice_score(small.to_image(small.targets) > 0.5, mask)[0]) < dice


@pytest.mark.parametrize("f", [2, 4, 8, 16])
def test_bool_masks_pool_exactly_by_byte_counting(f: int) -> None:
    """Pooling a bool mask by counting bytes equals avg_pool2d of its 0/1 floats, bit for bit."""
    from slipstream.vision.tokens import _pool_strips

    g = torch.Generator().manual_seed(f)
    for p in (0.0, 0.3, 1.0):
        m = torch.rand(2, 1, 64, 128, generator=g) < p
        for x in (m, m[:, :, :, :64]):  # contiguous and strided
            assert torch.equal(_pool_strips(x, f), F.avg_pool2d(x.float(), f))


@pytest.mark.parametrize("f", [2, 8, 32])
def test_numba_integer_pooling_equals_torch_for_masks_and_uint8_images(f: int) -> None:
    """The numba kernel pools bool/uint8 planes exactly as torch's avg_pool2d of their floats."""
    pytest.importorskip("numba")
    from slipstream.vision.tokens import _pool_strips, resolve_pool_backend

    g = torch.Generator().manual_seed(f)
    u8 = (torch.rand(2, 3, 64, 128, generator=g) * 256).to(torch.uint8)
    u8[0, 0] = 255  # the largest column sums
    for x in (u8, u8 > 128, u8[:, :, :, :64], u8[:, :1] > 17):  # incl. strided, one channel
        assert resolve_pool_backend("auto", x, f) == "numba"
        got = _pool_strips(x, f, backend="numba")
        assert torch.equal(got, F.avg_pool2d(x.float(), f)), (x.dtype, x.shape)
        assert torch.equal(_pool_strips(x, f, backend="torch"), got)
    # what numba does not cover stays on torch (whatever the backend says)
    assert resolve_pool_backend("numba", u8.float(), f) == "torch"
    assert resolve_pool_backend("numba", u8, 3) == "torch"
    with pytest.raises(ValueError, match=r"backend='fast'.*'auto', 'torch' or 'numba'"):
        resolve_pool_backend("fast", u8, f)


@pytest.mark.parametrize("mode", ["area", "nearest"])
def test_uint8_images_give_the_tokens_of_their_float_values(mode: str) -> None:
    """uint8 images are gathered/pooled without a float copy; tokens equal those of .float()."""
    images, leaves = _mixed_leaves()
    u8 = (images * 255).round().to(torch.uint8)
    for backend in ("torch", "auto"):
        got = extract_tokens(u8, leaves, 8, mode, backend)  # type: ignore[arg-type]
        assert got.dtype == torch.float32
        assert torch.equal(got, extract_tokens(u8.float(), leaves, 8, mode))  # type: ignore[arg-type]


def test_tokens_from_edge_pass_means_match_the_pyramid() -> None:
    """Tokens built on the edge pass's means (small leaves filtered from their own pixels)
    equal the pyramid's exactly for uint8 images and to float rounding for float32 ones."""
    pytest.importorskip("numba")
    images, leaves = _mixed_leaves()  # leaf sides 2..64 around P = 4: every code path
    u8 = (images * 255).round().to(torch.uint8)
    for f in (2, 4, 8, 16):
        for x in (u8, images):
            means = (f, F.avg_pool2d(x.float(), f))
            got = extract_tokens(x, leaves, 4, "area", means=means)
            ref = extract_tokens(x, leaves, 4, "area", backend="torch")
            if x.dtype == torch.uint8:
                assert torch.equal(got, ref), f
            else:
                torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"means=\(factor=8, shape \(2, 3, 4, 4\)\) do not fit"):
        extract_tokens(u8, leaves, 4, "area", means=(8, torch.zeros(2, 3, 4, 4)))
    with pytest.raises(ValueError, match="means are for mode='area'"):
        extract_tokens(u8, leaves, 4, "nearest", means=(8, F.avg_pool2d(u8.float(), 8)))
