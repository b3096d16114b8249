"""Edge detection: parity with scikit-image's Canny and the detector's own invariants."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from slipstream.vision import canny, gaussian_blur, gaussian_kernel_sigma, to_grey
from slipstream.vision.canny import _hysteresis


def _ref_canny(img: np.ndarray, sigma: float, lo: float, hi: float) -> np.ndarray:
    feature = pytest.importorskip("skimage.feature")
    return feature.canny(img, sigma=sigma, low_threshold=lo, high_threshold=hi)


@pytest.mark.parametrize(
    ("name", "sigma", "lo", "hi"),
    [("camera", 1.0, 50, 100), ("coins", 2.0, 20, 40), ("camera", 0.0, 100, 200)],
)
def test_canny_matches_scikit_image_pixel_for_pixel(
    name: str, sigma: float, lo: float, hi: float
) -> None:
    """Our batched Canny equals skimage.feature.canny on bundled images (<= 2 pixels differ)."""
    data = pytest.importorskip("skimage.data")
    img = getattr(data, name)()[:160, :192].astype(np.float64)
    ref = _ref_canny(img, sigma, lo, hi)
    ours = canny(torch.from_numpy(img), lo, hi, sigma=sigma).numpy()
    assert ref.sum() > 200
    assert (ref != ours).sum() <= 2


def test_batched_canny_equals_per_image() -> None:
    """A batch gives the same edge maps as each image alone (thresholds per image too)."""
    g = torch.Generator().manual_seed(0)
    x = gaussian_blur(torch.rand(3, 48, 48, generator=g) * 255, sigma=1.5)
    for relative in (False, True):
        lo, hi = (0.2, 0.4) if relative else (10.0, 20.0)
        batched = canny(x, lo, hi, relative=relative)
        single = torch.stack([canny(x[i], lo, hi, relative=relative) for i in range(3)])
        assert torch.equal(batched, single) and batched.any()


def test_border_is_never_an_edge_and_flat_image_has_none() -> None:
    """A flat image has no edges; a step touching the border marks no border pixel."""
    assert not canny(torch.full((32, 32), 128.0)).any()
    x = torch.zeros(32, 32)
    x[:, 16:] = 255.0
    e = canny(x)
    assert e[1:-1, 15:17].any()
    assert not (e[0].any() or e[-1].any() or e[:, 0].any() or e[:, -1].any())


def test_relative_thresholds_are_scale_free_and_absolute_ones_are_not() -> None:
    """Scaling intensities keeps relative-threshold edges and changes absolute ones."""
    g = torch.Generator().manual_seed(1)
    x = gaussian_blur(torch.rand(64, 64, generator=g) * 255, sigma=2.0)
    assert torch.equal(canny(x, 0.1, 0.3, relative=True), canny(0.25 * x, 0.1, 0.3, relative=True))
    assert canny(0.25 * x, 5, 10).sum() < canny(x, 5, 10).sum()


@pytest.mark.parametrize("name", ["camera", "coins", "immunohistochemistry"])
def test_more_blur_gives_fewer_edges(name: str) -> None:
    """Monotonicity (spec 1.5): a wider Gaussian before Canny leaves fewer edge pixels."""
    pytest.importorskip("skimage")
    from slipstream.vision import bundled_image

    x = to_grey(bundled_image(name)).round()[:, :256, :256]
    counts = [
        int(canny(gaussian_blur(x, kernel_size=k), 100, 200, norm="l1").sum()) for k in (1, 3, 5, 7)
    ]
    assert counts == sorted(counts, reverse=True) and counts[0] > counts[-1]


def test_l1_norm_keeps_more_edges_than_l2() -> None:
    """|gi| + |gj| >= the Euclidean norm, so the same thresholds keep more edge pixels."""
    data = pytest.importorskip("skimage.data")
    x = torch.from_numpy(data.camera()[128:384, 128:384].astype(np.float32))
    assert canny(x, 100, 200, norm="l1").sum() > 1.1 * canny(x, 100, 200, norm="l2").sum()


def test_hysteresis_matches_connected_component_labelling() -> None:
    """Sparse hooking + pointer jumping keeps exactly the 8-connected weak components with a strong pixel."""
    ndi = pytest.importorskip("scipy.ndimage")
    g = torch.Generator().manual_seed(3)
    weak = torch.rand(2, 64, 64, generator=g) < 0.45
    weak[:, 0] = weak[:, -1] = False
    weak[:, :, 0] = weak[:, :, -1] = False
    strong = weak & (torch.rand(2, 64, 64, generator=g) < 0.01)
    idx = weak.reshape(-1).nonzero().squeeze(1)
    ours = _hysteresis(idx, strong.reshape(-1)[idx], weak.shape)
    for b in range(2):
        labels, _ = ndi.label(weak[b].numpy(), np.ones((3, 3)))
        good = np.unique(labels[strong[b].numpy()])
        ref = np.isin(labels, good[good > 0])
        assert np.array_equal(ours[b].numpy(), ref)


def test_grey_blur_and_argument_errors() -> None:
    """BT.601 grey on 0-255, OpenCV's sigma rule, and errors naming the bad argument."""
    rgb = torch.tensor([1.0, 0.0, 0.0]).view(1, 3, 1, 1)
    assert torch.allclose(to_grey(rgb), torch.tensor([[[0.299 * 255]]]))
    assert torch.allclose(to_grey((rgb * 255).to(torch.uint8)), to_grey(rgb))  # uint8: 0-255
    assert torch.allclose(to_grey((rgb * 65535).to(torch.int32)), to_grey(rgb * 65535 / 2**31))
    with pytest.raises(ValueError, match="got bool"):
        to_grey(rgb > 0)
    assert gaussian_kernel_sigma(3) == pytest.approx(0.8)
    assert gaussian_kernel_sigma(5) == pytest.approx(1.1)
    with pytest.raises(ValueError, match="kernel_size=4"):
        gaussian_kernel_sigma(4)
    with pytest.raises(ValueError, match=r"low=200.*high=100"):
        canny(torch.zeros(8, 8), 200, 100)
    with pytest.raises(ValueError, match="channels"):
        to_grey(torch.zeros(1, 2, 4, 4))


@pytest.mark.parametrize("blur", [1, 3, 5])
@pytest.mark.parametrize("norm", ["l1", "l2"])
def test_strip_wise_edge_points_equal_the_dense_pipeline(blur: int, norm: str) -> None:
    """edge_points (row strips with halos, sparse hysteresis) == grey -> blur -> canny, exactly."""
    from slipstream.vision import synthetic_blobs
    from slipstream.vision.edges import edge_points

    images, _ = synthetic_blobs(2, 128, seed=3)
    images = images[:, :, :100]  # non-square, and strips that do not divide the height
    grey1 = images[:, :1] * 0.7
    rgba = torch.cat([images, torch.ones_like(images[:, :1])], 1)
    u8 = (images * 255).round().to(torch.uint8)
    for x, lo, hi, rel in ((images, 100.0, 200.0, False), (images, 0.1, 0.3, True),
                           (grey1, 20.0, 40.0, False), (rgba, 100.0, 200.0, False),
                           (u8, 100.0, 200.0, False)):  # fmt: skip
        grey = gaussian_blur(to_grey(x).round(), kernel_size=blur)
        dense = canny(grey, lo, hi, relative=rel, norm=norm)  # type: ignore[arg-type]
        ref = dense.reshape(-1).nonzero().squeeze(1)
        assert ref.numel() > 50
        for rows in (1, 7, 32, None):
            got = edge_points(x, blur_kernel=blur, low=lo, high=hi, relative=rel, norm=norm,  # type: ignore[arg-type]
                              strip_rows=rows, backend="torch")  # fmt: skip
            assert torch.equal(got, ref), (rows, got.numel(), ref.numel())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_edge_sqrt_is_correctly_rounded(dtype: torch.dtype) -> None:
    """The l2 pipeline's sqrt is IEEE's on any CPU (torch's CPU sqrt goes through MKL, which
    is one ulp off for 15% of float32 values on AMD EPYC), so backends agree on every vendor."""
    import math

    from slipstream.vision.edges import _sqrt_rn

    g = torch.Generator().manual_seed(0)
    x = (torch.rand(20_000, generator=g, dtype=torch.float64) * 1e5).to(dtype)
    ref = torch.tensor([math.sqrt(v) for v in x.tolist()], dtype=torch.float64).to(dtype)
    assert torch.equal(_sqrt_rn(x), ref)


@pytest.mark.parametrize("blur", [1, 3, 7])
@pytest.mark.parametrize("norm", ["l1", "l2"])
def test_numba_edge_backend_is_bit_identical_to_torch(blur: int, norm: str) -> None:
    """The fused numba kernel rounds exactly as the torch strips (FMA where torch fuses)."""
    pytest.importorskip("numba")
    from slipstream.vision import synthetic_blobs
    from slipstream.vision.edges import edge_points

    images, _ = synthetic_blobs(2, 96, seed=5)
    ramp = torch.linspace(0, 1, 40).expand(1, 1, 40, 40) * torch.linspace(0.2, 1, 40).view(
        1, 1, 40, 1
    )
    cases = [
        (images, 100.0, 200.0, False),
        (images[:, :, :70].contiguous(), 0.1, 0.3, True),  # non-square, relative thresholds
        (images[:, :1] * 0.7, 20.0, 40.0, False),  # one channel
        (torch.cat([images, torch.ones_like(images[:, :1])], 1), 100.0, 200.0, False),  # RGBA
        (images.double(), 100.0, 200.0, False),
        ((images * 255).round().to(torch.uint8), 100.0, 200.0, False),  # 8-bit, 0-255
        ((images[:, :1] * 255).to(torch.uint8), 0.1, 0.3, True),
        (ramp, 1.0, 2.0, False),  # equal magnitudes everywhere: the tie-breaking rules
        (images, 0.0, 150.0, False),  # low = 0: flat pixels are candidates with 0/0 weights
    ]
    for x, lo, hi, rel in cases:
        ref = edge_points(x, blur_kernel=blur, low=lo, high=hi, relative=rel, norm=norm,  # type: ignore[arg-type]
                          backend="torch")  # fmt: skip
        assert ref.numel() > 20
        for rows in (1, 9, None):
            got = edge_points(x, blur_kernel=blur, low=lo, high=hi, relative=rel, norm=norm,  # type: ignore[arg-type]
                              backend="numba", strip_rows=rows)  # fmt: skip
            assert torch.equal(got, ref), (x.shape, x.dtype, rows, got.numel(), ref.numel())


def test_edge_backend_errors_name_the_fix() -> None:
    from slipstream.vision.edges import edge_points, resolve_edge_backend

    x = torch.rand(1, 3, 16, 16)
    with pytest.raises(ValueError, match=r"backend='gpu'.*'auto', 'torch' or 'numba'"):
        edge_points(x, backend="gpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"float16.*backend='torch'"):
        resolve_edge_backend("numba", x.half())
    assert resolve_edge_backend("auto", x.half()) == "torch"


def test_numba_hysteresis_equals_the_torch_components() -> None:
    """Union-find over merged neighbour lists keeps exactly the torch pass's pixels."""
    pytest.importorskip("numba")
    from slipstream.vision._numba_kernels import hysteresis
    from slipstream.vision.edges import _hysteresis_sparse

    g = torch.Generator().manual_seed(0)
    h = w = 64
    inner = torch.zeros(2, h, w, dtype=torch.bool)
    inner[:, 1:-1, 1:-1] = torch.rand(2, h - 2, w - 2, generator=g) < 0.35  # long chains
    idx = inner.flatten().nonzero().squeeze(1)
    for p in (0.0, 0.01, 0.2, 1.0):
        strong = torch.rand(idx.numel(), generator=g) < p
        ref = _hysteresis_sparse(idx, strong, w)
        got = torch.from_numpy(hysteresis(idx.numpy(), strong.numpy(), w))
        assert torch.equal(got, ref), p
        assert 0 < ref.numel() < idx.numel() or p in (0.0, 1.0)


def test_edge_points_and_means_pool_the_image_in_the_edge_pass() -> None:
    """One pass gives the edge pixels of edge_points and the f x f means of the image."""
    pytest.importorskip("numba")
    from slipstream.vision import synthetic_blobs
    from slipstream.vision.edges import edge_points, edge_points_and_means

    images, _ = synthetic_blobs(2, 128, seed=1)
    u8 = (images * 255).round().to(torch.uint8)
    for x in (u8, images, u8[:, :1].contiguous(), torch.cat([u8, u8[:, :1]], 1)):
        ref_points = edge_points(x, backend="torch")
        for f, rows in ((2, 1), (8, 9), (32, None), (128, None)):
            points, means = edge_points_and_means(x, f, strip_rows=rows)
            assert torch.equal(points, ref_points)
            ref = F.avg_pool2d(x.float(), f)
            if x.dtype == torch.uint8:  # integer sums: exact
                assert torch.equal(means, ref), (f, rows)
            else:  # float32 sums of up to f * f values in another order
                torch.testing.assert_close(means, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"factor=12 must be a power of two"):
        edge_points_and_means(u8, 12)
    with pytest.raises(ValueError, match=r"float32 or uint8 CPU images, got torch.float64"):
        edge_points_and_means(images.double(), 8)


def test_without_numba_auto_falls_back_to_torch_and_numba_names_the_fix(monkeypatch) -> None:
    """One backend rule for edges and pooling: 'auto' uses torch (logging once), 'numba' raises."""
    from slipstream.vision import edges
    from slipstream.vision.tokens import resolve_pool_backend

    monkeypatch.setattr(edges, "_numba_installed", lambda: False)
    monkeypatch.setattr(edges, "_warned_no_numba", False)
    x = (torch.rand(1, 3, 16, 16) * 255).to(torch.uint8)
    assert edges.resolve_edge_backend("auto", x) == "torch"
    assert resolve_pool_backend("auto", x, 8) == "torch"
    assert edges._warned_no_numba
    for resolve in (lambda: edges.resolve_edge_backend("numba", x),
                    lambda: resolve_pool_backend("numba", x, 8)):  # fmt: skip
        with pytest.raises(ImportError, match=r"pip install numba"):
            resolve()
    with pytest.raises(ValueError, match=r"backend='gpu' is unknown"):
        resolve_pool_backend("gpu", x, 8)
