"""The fake quantizers against hand-computed values, and their straight-through gradient."""

from __future__ import annotations

import torch

from slipstream.compression.quantizers import (
    asymmetric_quantize,
    binary_quantize,
    quantize_weight,
    symmetric_quantize,
    ternary_quantize,
    topk_mask,
)


def test_symmetric_levels_and_groups() -> None:
    """4 bits: scale = 2 absmax / 16, levels -8..7 (so +absmax clamps to 7 scales)."""
    x = torch.tensor([[-1.0, -0.3, 0.2, 1.0], [0.5, -0.5, 0.1, 0.0]])
    got = symmetric_quantize(x, 4, num_groups=2)
    s1, s2 = 2 * 1.0 / 16, 2 * 0.5 / 16
    want = torch.tensor(
        [[-8 * s1, -2 * s1, 2 * s1, 7 * s1], [7 * s2, -8 * s2, 2 * s2, 0.0]]
    )  # -0.3/0.125 = -2.4 -> -2; 0.2/0.125 = 1.6 -> 2; 0.1/0.0625 = 1.6 -> 2
    torch.testing.assert_close(got, want)


def test_symmetric_static_range() -> None:
    """A fixed range (static activations): the scale comes from max(|lo|, hi)."""
    x = torch.tensor([0.3, -2.0, 0.9])
    got = symmetric_quantize(x, 8, torch.tensor(-1.0), torch.tensor(0.5))
    scale = 2 * 1.0 / 256
    want = torch.tensor([round(0.3 / scale), -128, round(0.9 / scale)]) * scale
    torch.testing.assert_close(got, want)


def test_asymmetric_zero_point() -> None:
    """2^bits levels from the rounded zero point: min maps to level 0."""
    x = torch.tensor([-0.5, 0.0, 1.0, 1.5])
    got = asymmetric_quantize(x, 2)
    scale = 2.0 / 4
    zero = round(-0.5 / scale) * scale
    want = (((x - zero) / scale).round().clamp(0, 3)) * scale + zero
    torch.testing.assert_close(got, want)
    assert got[0] == -0.5 and got[-1] == 1.0  # 1.5 clamps to the top level


def test_ternary_and_binary() -> None:
    x = torch.tensor([[0.9, -0.1, -1.1, 0.2]])
    # mean |x| = 0.575, threshold 0.4025: keeps 0.9 and -1.1, alpha = 1.0
    torch.testing.assert_close(ternary_quantize(x), torch.tensor([[1.0, 0.0, -1.0, 0.0]]))
    torch.testing.assert_close(binary_quantize(x), torch.tensor([[1, -1, -1, 1.0]]) * 0.575)
    assert quantize_weight(x, 2, "symmetric", 1).unique().numel() == 3


def test_straight_through_gradient() -> None:
    """Quantization-aware training: the gradient reaches the full-precision tensor unchanged."""
    for fn in (
        lambda t: symmetric_quantize(t, 4, num_groups=2),
        lambda t: asymmetric_quantize(t, 4),
        lambda t: ternary_quantize(t),
        lambda t: topk_mask(t, 0.5),
    ):
        x = torch.randn(2, 6, requires_grad=True)
        g = torch.randn(2, 6)
        fn(x).backward(g)
        torch.testing.assert_close(x.grad, g)


def test_topk_keeps_ceil_ratio_largest() -> None:
    scores = torch.tensor([0.1, 0.7, -0.2, 0.4, 0.3])
    torch.testing.assert_close(topk_mask(scores, 0.5), torch.tensor([0, 1, 0, 1, 1.0]))
