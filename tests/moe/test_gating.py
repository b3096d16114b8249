"""Gating and layer properties that need no DeepSpeed: capacity, dropped tokens, the aux loss
on a hand-computed case, DeepSpeed's utils, routing statistics and the error messages."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from slipstream.moe import MoE
from slipstream.moe.gating import capacity_for, top1_routes, top2_routes, topk_routes
from slipstream.moe.utils import (
    has_moe_layers,
    is_moe_param,
    split_params_into_different_moe_groups_for_optimizer,
)


def test_capacity_formula() -> None:
    """ceil(tokens / experts * factor), never below min_capacity."""
    assert capacity_for(30, 4, 1.0, 4) == 8
    assert capacity_for(30, 4, 0.5, 4) == 4
    assert capacity_for(30, 4, 0.5, 0) == 4  # ceil(3.75)
    assert capacity_for(8, 4, 1.0, 5) == 5


@pytest.mark.parametrize("k", [1, 2, 3])
def test_capacity_is_respected(k: int) -> None:
    """No expert gets more kept choices than its capacity, and slots are distinct."""
    logits = torch.randn(64, 4, generator=torch.Generator().manual_seed(k))
    logits[:, 0] += 3.0  # overload expert 0
    if k == 1:
        r = top1_routes(logits, 1.0, 2)
    elif k == 2:
        r = top2_routes(logits, 1.0, 2)
    else:
        r = topk_routes(logits, 3, 1.0, 2)
    kept = r.experts >= 0
    assert (~kept).any(), "the overloaded expert should drop tokens"
    for e in range(4):
        slots = r.slots[r.experts == e]
        assert slots.numel() <= r.capacity
        assert slots.unique().numel() == slots.numel()
        assert slots.numel() == 0 or int(slots.max()) < r.capacity
    assert torch.all(r.weights[~kept] == 0)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_dropless_capacity_is_agreed_only_when_read(
    k: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """drop_tokens=False: the routes keep every choice without the group's all-reduce; it
    runs once, when DeepSpeed's dense form (or ``capacity``) is read, and gives the max."""
    from slipstream.moe import gating

    calls: list[int] = []

    def fake_all_reduce(t: torch.Tensor, **kwargs: object) -> None:
        calls.append(int(t.item()))
        t.fill_(100)  # another rank's busiest expert is busier

    monkeypatch.setattr(gating.comm, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(gating.comm, "all_reduce", fake_all_reduce)
    logits = torch.randn(64, 4, generator=torch.Generator().manual_seed(k))
    logits[:, 0] += 3.0
    group = object()
    if k == 1:
        r = top1_routes(logits, 1.0, 0, drop_tokens=False, ep_group=group)
    elif k == 2:
        r = top2_routes(logits, 1.0, 0, drop_tokens=False, ep_group=group)
    else:
        r = topk_routes(logits, 3, 1.0, 0, drop_tokens=False, ep_group=group)
    assert bool((r.experts >= 0).all()), "dropless routing keeps every choice"
    assert calls == []
    combine, _ = r.dense()
    assert calls == [int(r.exp_counts.max())]
    assert r.capacity == (64 if k == 1 else 100)  # top-1 caps it at the token count
    assert combine.shape == (64, 4, r.capacity)
    assert len(calls) == 1


def test_top1_aux_loss_hand_computed() -> None:
    """l_aux = E * sum_e(mean gate_e * fraction_e) on a 4-token, 2-expert case."""
    logits = torch.tensor([[0.0, math.log(3.0)], [0.0, 0.0], [math.log(3.0), 0.0], [0.0, 1.0]])
    r = top1_routes(logits, 2.0, 0, use_rts=False)
    # gates: [.25,.75], [.5,.5], [.75,.25], [1/(1+e), e/(1+e)]; argmax ties go to expert 0
    p = 1 / (1 + math.e)
    me = [(0.25 + 0.5 + 0.75 + p) / 4, (0.75 + 0.5 + 0.25 + (1 - p)) / 4]
    ce = [2 / 4, 2 / 4]
    assert r.l_aux.item() == pytest.approx(2 * (me[0] * ce[0] + me[1] * ce[1]), rel=1e-6)
    assert r.exp_counts.tolist() == [2, 2]


def test_dropped_tokens_give_zero_output() -> None:
    """A token whose every choice was dropped leaves the layer as zeros (no residual)."""
    torch.manual_seed(0)
    layer = MoE(8, nn.Linear(8, 8), num_experts=2, k=1, capacity_factor=0.25, min_capacity=1)
    x = torch.randn(16, 8)
    out, _, counts = layer(x)
    stats = layer.stats
    assert stats is not None and stats.dropped_fraction > 0
    zero_rows = (out == 0).all(dim=1)
    assert int(zero_rows.sum()) == 16 - int(stats.kept_per_expert.sum())
    assert stats.tokens_per_expert.tolist() == counts.tolist()


def test_every_expert_gets_a_gradient_even_without_tokens() -> None:
    """An expert that receives no token still has a (zero) gradient, so reductions agree."""
    torch.manual_seed(0)
    layer = MoE(4, nn.Linear(4, 4), num_experts=3, k=1, drop_tokens=False)
    with torch.no_grad():
        layer.deepspeed_moe.gate.wg.weight.copy_(torch.tensor([[1.0] * 4, [0.0] * 4, [-1.0] * 4]))
    out, _, counts = layer(torch.rand(12, 4) + 0.1)
    out.sum().backward()
    assert counts.tolist() == [12, 0, 0]
    idle = layer.deepspeed_moe.experts.deepspeed_experts[2].weight.grad
    assert idle is not None and torch.all(idle == 0)


def test_utils_split_groups_and_find_layers() -> None:
    """Expert parameters move to their own 'moe' group; has_moe_layers finds the layer."""
    model = nn.Sequential(nn.Linear(4, 4), MoE(4, nn.Linear(4, 4), num_experts=2))
    assert has_moe_layers(model) == (True, 2)
    assert has_moe_layers(nn.Linear(2, 2)) == (False, 0)
    expert = [p for p in model.parameters() if is_moe_param(p)]
    assert len(expert) == 4  # two experts, weight and bias each
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "dense", "lr": 0.1}
    )
    assert [g["name"] for g in groups] == ["dense", "ep_size_1"]
    assert groups[1]["moe"] is True and groups[1]["lr"] == 0.1
    assert {id(p) for p in groups[1]["params"]} == {id(p) for p in expert}
    assert not any(is_moe_param(p) for p in groups[0]["params"])


def test_errors_name_the_setting() -> None:
    with pytest.raises(ValueError, match="num_experts=3 must be divisible by ep_size=2"):
        MoE(4, nn.Linear(4, 4), num_experts=3, ep_size=2)
    with pytest.raises(ValueError, match="noisy_gate_policy='Gaussian'"):
        MoE(4, nn.Linear(4, 4), num_experts=2, noisy_gate_policy="Gaussian")
    layer = MoE(4, nn.Linear(4, 4), num_experts=4, ep_size=2)
    with pytest.raises(RuntimeError, match="expert_parallel_"):
        layer(torch.randn(8, 4))


@pytest.mark.parametrize("k", [1, 2, 3])
def test_sparse_routes_name_the_dense_entries(k: int) -> None:
    """sparse_routes=True: each kept route's (expert, slot, gate) is the one nonzero entry of
    its token's dense combine weights, a dropped route is expert -1 with gate 0, and the
    capacity is the dense form's last dimension."""
    from slipstream.moe import sharded_moe as sm

    logits = torch.randn(20, 5, generator=torch.Generator().manual_seed(k))
    fn = {1: sm.top1gating, 2: sm.top2gating, 3: sm.topkgating}[k]
    args = (0.5, 1) if k < 3 else (3, 0.5, 1)
    torch.manual_seed(0)
    l_aux, combine, _, counts = fn(logits, *args)
    torch.manual_seed(0)
    s_aux, capacity, experts, idx, loc, gates, s_counts = fn(logits, *args, sparse_routes=True)
    assert (s_aux, experts) == (l_aux, 5) and torch.equal(counts, s_counts)
    assert int(capacity) == combine.shape[2] and idx.dtype == loc.dtype == torch.int32
    assert idx.shape == (k, 20) and (idx < 0).any()  # capacity 0.5 drops some routes
    rebuilt = torch.zeros_like(combine)
    for r, t in zip(*torch.nonzero(idx >= 0, as_tuple=True), strict=True):
        rebuilt[t, idx[r, t], loc[r, t]] += gates[r, t]
    torch.testing.assert_close(rebuilt, combine, rtol=0, atol=0)
    assert torch.all(gates[idx < 0] == 0)
