"""Dropless router and grouped experts: grouped GEMM (both paths) equals a loop over experts,
the layer equals a per-token reference with nothing dropped, the z-loss and aux-loss-free
bias behave as their papers define, and ep_size 2 equals ep_size 1 on 2 ranks."""

from __future__ import annotations

import math

import pytest
import torch

from slipstream.moe import DroplessMoE, RouterConfig, grouped, routing_stats
from slipstream.moe import dropless as d
from tests.distributed.harness import run_world
from tests.moe import _ep_workloads as w


@pytest.mark.parametrize("path", ["grouped_mm", "padded_bmm"])
def test_grouped_mm_equals_a_loop(path: str) -> None:
    """Forward and gradients equal per-group matmuls, an empty group included."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 8, generator=g, requires_grad=True)
    wt = torch.randn(3, 8, 4, generator=g, requires_grad=True)
    counts = torch.tensor([4, 0, 6])
    fn = grouped.grouped_mm if path == "grouped_mm" else grouped._padded_bmm
    y = fn(x, wt, counts)
    ref = torch.cat([x[:4] @ wt[0], x[4:] @ wt[2]])
    torch.testing.assert_close(y, ref)
    (gx, gw) = torch.autograd.grad((y * y).sum(), (x, wt))
    (rx, rw) = torch.autograd.grad((ref * ref).sum(), (x, wt))
    torch.testing.assert_close(gx, rx)
    torch.testing.assert_close(gw, rw)
    assert torch.all(gw[1] == 0)


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_layer_equals_per_token_reference(activation: str, score_func: str) -> None:
    """Each token's output is the weighted sum of its k experts; nothing is dropped."""
    torch.manual_seed(0)
    cfg = RouterConfig(k=2, score_func=score_func, route_scale=1.5)  # type: ignore[arg-type]
    layer = DroplessMoE(8, 16, 4, router=cfg, activation=activation)  # type: ignore[arg-type]
    x = torch.randn(2, 9, 8)
    out, loss, counts = layer(x)
    flat = x.reshape(-1, 8)
    logits = flat @ layer.router.gate.weight.t()
    scores = logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()
    top = scores.topk(2, dim=-1)
    ex = layer.experts
    ref = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        wts = top.values[t] / top.values[t].sum() * 1.5
        for j in range(2):
            e = int(top.indices[t, j])
            h = flat[t] @ ex.w1[e]
            h = (
                torch.nn.functional.silu(h) * (flat[t] @ ex.w3[e])
                if ex.w3 is not None
                else (torch.nn.functional.gelu(h))
            )
            ref[t] += wts[j] * (h @ ex.w2[e])
    torch.testing.assert_close(out.reshape(-1, 8), ref, rtol=1e-5, atol=1e-5)
    assert int(counts.sum()) == 18 * 2
    stats = routing_stats(torch.nn.Sequential(layer))
    assert stats["moe/0/dropped_fraction"] == 0.0
    assert stats["moe/0/imbalance"] == pytest.approx(float(counts.max()) / 9.0)
    assert loss.item() > 0  # the default aux loss is on


def test_z_loss_hand_computed() -> None:
    """z-loss = coef * mean(logsumexp(logits)^2); with zero gate weights logits are 0."""
    router = d.TokenChoiceRouter(4, 3, RouterConfig(k=1, aux_loss_coef=0.0, z_loss_coef=0.1))
    torch.nn.init.zeros_(router.gate.weight)
    _, _, loss, _ = router(torch.randn(5, 4))
    assert loss.item() == pytest.approx(0.1 * math.log(3.0) ** 2, rel=1e-6)


def test_aux_loss_free_bias_moves_load_to_the_idle_expert() -> None:
    """DeepSeek-V3 balancing: the overloaded expert's bias falls, the idle one's rises, and
    the bias changes which expert is chosen but not the combine weights' source scores."""
    torch.manual_seed(0)
    layer = DroplessMoE(4, 8, 2, router=RouterConfig(k=1, bias_update_rate=0.5))
    with torch.no_grad():
        layer.router.gate.weight.copy_(torch.tensor([[1.0] * 4, [0.0] * 4]))
    x = torch.rand(16, 4) * 0.1 + 0.01
    _, _, counts = layer(x)
    assert counts.tolist() == [16, 0]
    layer.update_bias_()
    assert layer.router.expert_bias.tolist() == [-0.5, 0.5]
    assert float(layer.router.load.sum()) == 0
    _, _, counts = layer(x)
    assert counts.tolist() == [0, 16]  # scores differ by < 0.5: the bias decides


def test_errors() -> None:
    with pytest.raises(ValueError, match="divisible by ep_size=3"):
        DroplessMoE(4, 8, 4, ep_size=3)
    with pytest.raises(ValueError, match="score_func='tanh'"):
        RouterConfig(score_func="tanh")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="k=3 exceeds num_experts=2"):
        DroplessMoE(4, 8, 2, router=RouterConfig(k=3))


def test_dropless_ep2_equals_one_process() -> None:
    """On 2 ranks, with uneven routing and an idle expert: forward, gradients, parameters."""
    for res in run_world(w.dropless_ep, 2):
        for a, b in zip(res["outs"], res["ref_outs"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        for name, p in res["params"].items():
            torch.testing.assert_close(p, res["ref_params"][name], rtol=1e-5, atol=1e-6)
        assert int(res["counts"][3]) == 0 and res["counts"][:3].min() >= 0


def test_grouped_forms_equal_the_expert_loop() -> None:
    """The registered grouped forms (Sequential MLP, the GPT's SwiGLU MLP) equal running
    each expert on its block, forward and gradients, an empty block included."""
    from slipstream.models.gpt import MLP, GPTConfig
    from slipstream.moe.experts import _GROUPED, Experts

    torch.manual_seed(0)
    cases = [
        torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.GELU(), torch.nn.Linear(12, 8)),
        MLP(GPTConfig.preset("tiny", hidden_size=8, num_heads=2, num_kv_heads=2)),
    ]
    for expert in cases:
        experts = Experts(expert, 3)
        for e in experts.deepspeed_experts:
            for p in e.parameters():
                torch.nn.init.normal_(p)
        rows = torch.randn(9, 8)
        counts = [4, 0, 5]
        loop = torch.cat([experts.run(i, b) for i, b in enumerate(rows.split(counts))])
        fn = _GROUPED[type(expert)]
        fast = fn(list(experts.deepspeed_experts), rows, torch.tensor(counts))
        assert fast is not None
        torch.testing.assert_close(fast, loop, rtol=1e-5, atol=1e-5)
        params = list(experts.parameters())
        g_loop = torch.autograd.grad((loop**2).sum(), params)
        g_fast = torch.autograd.grad((fast**2).sum(), params)
        for a, b in zip(g_fast, g_loop, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
