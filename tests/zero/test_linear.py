"""``deepspeed.runtime.zero.linear``: outputs and gradients equal ``nn.functional.linear``'s
(gradcheck in float64, every input rank, with and without bias), the module is ``nn.Linear``
with the same parameters, and autocast reaches the backward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from slipstream.zero.linear import (
    LinearFunctionForZeroStage3,
    LinearModuleForZeroStage3,
    zero3_linear_wrap,
)


@pytest.mark.parametrize("shape", [(5,), (4, 5), (2, 3, 5)])
@pytest.mark.parametrize("bias", [True, False])
def test_gradients_equal_functional_linear(shape: tuple[int, ...], bias: bool) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, generator=g, dtype=torch.float64, requires_grad=True) if bias else None
    inputs = (x, w, b) if bias else (x, w)
    assert torch.autograd.gradcheck(LinearFunctionForZeroStage3.apply, inputs)
    out = zero3_linear_wrap(x, w, b)
    ref = nn.functional.linear(x, w, b)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    up = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    ours = torch.autograd.grad(out, [t for t in inputs if t is not None], up)
    theirs = torch.autograd.grad(ref, [t for t in inputs if t is not None], up)
    for a, r in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-12)


def test_module_is_nn_linear_with_the_same_init() -> None:
    torch.manual_seed(3)
    ours = LinearModuleForZeroStage3(6, 4)
    torch.manual_seed(3)
    ref = nn.Linear(6, 4)
    assert dict(ours.state_dict()).keys() == dict(ref.state_dict()).keys()
    for k, v in ref.state_dict().items():
        assert torch.equal(ours.state_dict()[k], v)
    x = torch.randn(2, 6)
    torch.testing.assert_close(ours(x), ref(x), rtol=1e-6, atol=1e-6)
    assert LinearModuleForZeroStage3(6, 4, bias=False).bias is None
    assert "in_features=6, out_features=4, bias=True" in repr(ours)


def test_under_autocast_matches_functional_linear() -> None:
    """bf16 autocast on the CPU: output dtype and gradients as ``nn.functional.linear``'s
    (bf16 products: 1e-2 relative)."""
    g = torch.Generator().manual_seed(1)
    grads = []
    for fn in (zero3_linear_wrap, nn.functional.linear):
        w = torch.randn(3, 5, generator=g.manual_seed(1), requires_grad=True)
        x = torch.randn(4, 5, generator=g, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn(x, w)
        assert out.dtype == torch.bfloat16
        out.float().square().sum().backward()
        grads.append((x.grad, w.grad))
    for a, r in zip(grads[0], grads[1], strict=True):
        assert a is not None and r is not None and a.dtype == r.dtype == torch.float32
        torch.testing.assert_close(a, r, rtol=1e-2, atol=1e-2)
