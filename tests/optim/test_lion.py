"""Lion: updates match the sign-momentum formulas; convergence; bf16 params."""

from __future__ import annotations

import pytest
import torch

from slipstream.optim import Lion


def test_two_steps_match_formulas() -> None:
    """Two steps with decoupled weight decay, computed by hand."""
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.0], dtype=torch.float64))
    opt = Lion([w], lr=0.1, betas=(0.9, 0.99), weight_decay=0.5)
    w.grad = torch.tensor([0.5, -0.1, 0.0], dtype=torch.float64)
    opt.step()
    # c = 0.1 * g -> sign = [1, -1, 0]; w = w * (1 - 0.05) - 0.1 * sign; m = 0.01 * g
    expected = [0.95 - 0.1, -1.9 + 0.1, 0.0]
    assert w.tolist() == pytest.approx(expected)
    assert opt.state[w]["exp_avg"].tolist() == pytest.approx([0.005, -0.001, 0.0])

    w.grad = torch.tensor([-0.01, -0.1, 1.0], dtype=torch.float64)
    opt.step()
    # c = 0.9 * m + 0.1 * g = [0.0035, -0.0109, 0.1] -> sign = [1, -1, 1]
    expected = [e * 0.95 - 0.1 * s for e, s in zip(expected, [1, -1, 1])]
    assert w.tolist() == pytest.approx(expected)
    m = [0.99 * 0.005 + 0.01 * -0.01, 0.99 * -0.001 + 0.01 * -0.1, 0.01]
    assert opt.state[w]["exp_avg"].tolist() == pytest.approx(m)


def test_converges_on_quadratic() -> None:
    """With a decaying lr, Lion drives a small quadratic close to its minimum."""
    torch.manual_seed(0)
    target = torch.randn(16)
    w = torch.nn.Parameter(torch.zeros(16))
    opt = Lion([w], lr=0.05)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=400)
    for _ in range(400):
        opt.zero_grad()
        loss = ((w - target) ** 2).sum()
        loss.backward()
        opt.step()
        sched.step()
    assert loss.item() < 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dtypes_keep_param_dtype_and_fp32_state(dtype: torch.dtype) -> None:
    """fp32 and bf16 params step in place; momentum is fp32 for both."""
    w = torch.nn.Parameter(torch.ones(4, dtype=dtype))
    opt = Lion([w], lr=0.125)
    w.grad = torch.tensor([1.0, -1.0, 2.0, 0.0], dtype=dtype)
    opt.step()
    assert w.dtype == dtype
    assert opt.state[w]["exp_avg"].dtype == torch.float32
    assert w.float().tolist() == [0.875, 1.125, 0.875, 1.0]
