"""Lamb: updates match the LAMB formulas step by step; trust-ratio clamps; convergence; bf16."""

from __future__ import annotations

import math

import pytest
import torch

from slipstream.optim import Lamb


def _lamb_reference(w, grads, lr, betas, eps, wd, max_coeff=10.0, min_coeff=0.01):
    """Plain-Python LAMB (You et al. 2019, Algorithm 2) on one layer given as a list."""
    b1, b2 = betas
    m = [0.0] * len(w)
    v = [0.0] * len(w)
    w = list(w)
    for t, g in enumerate(grads, start=1):
        m = [b1 * mi + (1 - b1) * gi for mi, gi in zip(m, g)]
        v = [b2 * vi + (1 - b2) * gi * gi for vi, gi in zip(v, g)]
        r = [
            (mi / (1 - b1**t)) / (math.sqrt(vi / (1 - b2**t)) + eps) + wd * wi
            for mi, vi, wi in zip(m, v, w)
        ]
        w_norm = math.sqrt(sum(x * x for x in w))
        r_norm = math.sqrt(sum(x * x for x in r))
        trust = min(max(w_norm / r_norm, min_coeff), max_coeff) if w_norm and r_norm else 1.0
        w = [wi - lr * trust * ri for wi, ri in zip(w, r)]
    return w


def _run(opt_kwargs, w0, grads, dtype=torch.float64):
    w = torch.nn.Parameter(torch.tensor(w0, dtype=dtype))
    opt = Lamb([w], **opt_kwargs)
    for g in grads:
        w.grad = torch.tensor(g, dtype=dtype)
        opt.step()
    return w, opt


def test_two_steps_match_formulas() -> None:
    """Two steps with weight decay equal the plain-Python LAMB reference."""
    w0, grads = [1.0, -2.0, 0.5], [[0.5, 0.1, -0.2], [-0.3, 0.2, 0.4]]
    w, _ = _run(dict(lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01), w0, grads)
    ref = _lamb_reference(w0, grads, 0.1, (0.9, 0.999), 1e-8, 0.01)
    assert w.tolist() == pytest.approx(ref, rel=1e-12)


def test_trust_ratio_is_clamped_and_one_for_zero_weights() -> None:
    """||w||/||r|| is clamped to [min_coeff, max_coeff]; zero weights use a ratio of 1."""
    grads = [[1.0, -1.0]]  # step 1: r = sign(g), ||r|| = sqrt(2)
    _, opt = _run(dict(lr=0.1), [100.0, 100.0], grads)
    assert opt.get_lamb_coeffs() == pytest.approx([10.0])
    _, opt = _run(dict(lr=0.1), [1e-4, 1e-4], grads)
    assert opt.get_lamb_coeffs() == pytest.approx([0.01])
    w, opt = _run(dict(lr=0.1), [0.0, 0.0], grads)
    assert opt.get_lamb_coeffs() == pytest.approx([1.0])
    assert w.tolist() == pytest.approx([-0.1, 0.1], rel=1e-6)


def test_eps_inside_sqrt_and_no_bias_correction() -> None:
    """eps_inside_sqrt puts eps under the root; bias_correction=False uses raw moments."""
    w, _ = _run(dict(lr=0.1, eps=0.5, eps_inside_sqrt=True, bias_correction=False), [3.0], [[2.0]])
    r = 0.1 * 2.0 / math.sqrt(0.001 * 4.0 + 0.5)  # m / sqrt(v + eps)
    assert w.item() == pytest.approx(3.0 - 0.1 * min(3.0 / r, 10.0) * r)


def test_converges_on_quadratic() -> None:
    """Loss of a small quadratic falls by more than 1e4x in 300 steps."""
    torch.manual_seed(0)
    target = torch.randn(8, 4)
    w = torch.nn.Parameter(torch.ones(8, 4))
    opt = Lamb([w], lr=0.05, weight_decay=0.0)
    first = None
    for _ in range(300):
        opt.zero_grad()
        loss = ((w - target) ** 2).sum()
        first = first if first is not None else loss.item()
        loss.backward()
        opt.step()
    assert loss.item() < first * 1e-4


def test_bf16_params_keep_fp32_state_and_track_fp32_run() -> None:
    """bf16 params get fp32 moments (kept across state_dict load) and follow the fp32 run."""
    w0, grads = [1.0, -2.0, 0.5], [[0.5, 0.1, -0.2], [-0.3, 0.2, 0.4]]
    w32, _ = _run(dict(lr=0.01), w0, grads, torch.float32)
    w16, opt = _run(dict(lr=0.01), w0, grads, torch.bfloat16)
    assert w16.dtype == torch.bfloat16
    assert opt.state[w16]["exp_avg_sq"].dtype == torch.float32
    torch.testing.assert_close(w16.float(), w32.detach(), atol=1e-2, rtol=1e-2)

    fresh = Lamb([torch.nn.Parameter(w16.detach().clone())], lr=0.01)
    fresh.load_state_dict(opt.state_dict())
    (p,) = fresh.param_groups[0]["params"]
    assert fresh.state[p]["exp_avg"].dtype == torch.float32
    torch.testing.assert_close(fresh.state[p]["exp_avg"], opt.state[w16]["exp_avg"])


def test_rejects_bad_hyperparameters() -> None:
    """Out-of-range values raise ValueError naming the argument."""
    p = [torch.nn.Parameter(torch.ones(1))]
    with pytest.raises(ValueError, match="betas"):
        Lamb(p, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="min_coeff"):
        Lamb(p, min_coeff=2.0, max_coeff=1.0)
