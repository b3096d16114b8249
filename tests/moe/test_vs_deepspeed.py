"""slipstream's MoE layer and gating equal DeepSpeed 0.19.8's on the same weights, inputs and
seeds (skipped when DeepSpeed is not installed): outputs, l_aux, exp_counts and gradients."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from slipstream.moe import MoE
from slipstream.moe import sharded_moe as ours

CASES: list[dict[str, Any]] = [
    {"k": 1},
    {"k": 1, "use_rts": False},
    {"k": 1, "capacity_factor": 0.5, "min_capacity": 2},
    {"k": 1, "drop_tokens": False},
    {"k": 1, "noisy_gate_policy": "RSample"},
    {"k": 1, "noisy_gate_policy": "Jitter", "capacity_factor": 0.75},
    {"k": 1, "use_residual": True},
    {"k": 2},
    {"k": 2, "top2_2nd_expert_sampling": False, "capacity_factor": 0.5},
    {"k": 2, "drop_tokens": False},
    {"k": 3, "capacity_factor": 0.5},
    {"k": 3, "drop_tokens": False},
]


@pytest.fixture(scope="module")
def ds_moe() -> Any:
    pytest.importorskip("deepspeed")
    from tests.compat._deepspeed import import_deepspeed

    import_deepspeed()
    import deepspeed.moe.layer
    import deepspeed.moe.sharded_moe

    return deepspeed.moe


def _expert() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))


def _run(layer: nn.Module, x: torch.Tensor, seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    out, l_aux, counts = layer(x)
    ((out**2).sum() + l_aux).backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    return {"out": out.detach(), "l_aux": l_aux.detach(), "counts": counts, "grads": grads}


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_layer_equals_deepspeed(ds_moe: Any, case: dict[str, Any]) -> None:
    """Same output, aux loss, expert counts and gradients as deepspeed.moe.layer.MoE."""
    torch.manual_seed(0)
    kwargs = {"num_experts": 4, "min_capacity": 4, **case}
    theirs = ds_moe.layer.MoE(8, _expert(), **kwargs)
    mine = MoE(8, _expert(), **kwargs)
    assert mine.state_dict().keys() == theirs.state_dict().keys()
    mine.load_state_dict(theirs.state_dict())
    x = torch.randn(3, 10, 8)
    a, b = _run(theirs, x, 7), _run(mine, x, 7)
    torch.testing.assert_close(b["out"], a["out"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b["l_aux"], a["l_aux"], rtol=1e-6, atol=1e-7)
    assert torch.equal(b["counts"].long(), a["counts"].long())
    assert b["grads"].keys() == a["grads"].keys()
    for name in a["grads"]:
        torch.testing.assert_close(b["grads"][name], a["grads"][name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_gating_functions_equal_deepspeed(ds_moe: Any, k: int) -> None:
    """top1gating/top2gating/topkgating give DeepSpeed's dense combine weights and masks."""
    sm = ds_moe.sharded_moe
    logits = torch.randn(24, 6, generator=torch.Generator().manual_seed(k))
    if k == 1:
        calls = (
            lambda m: m.top1gating(logits.clone(), 0.5, 2),
            lambda m: m.top1gating(logits.clone(), 1.0, 2, noisy_gate_policy="RSample"),
        )
    elif k == 2:
        calls = (lambda m: m.top2gating(logits.clone(), 0.5, 2),)
    else:
        calls = (lambda m: m.topkgating(logits.clone(), 3, 0.5, 2),)
    for call in calls:
        torch.manual_seed(1)
        expected = call(sm)
        torch.manual_seed(1)
        got = call(ours)
        for e, g in zip(expected, got, strict=True):
            torch.testing.assert_close(g.float(), e.float(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("drop_tokens", [True, False])
def test_sparse_routes_equal_deepspeed(ds_moe: Any, k: int, drop_tokens: bool) -> None:
    """sparse_routes=True (what DeepSpeed's own MOELayer asks its gate for): the same
    (l_aux, capacity, num_experts, indices, locations, gates, exp_counts), dtypes included,
    from the functions and from TopKGate.forward(input, used_token, sparse_routes, use_tutel)."""
    torch.manual_seed(0)
    theirs = ds_moe.sharded_moe.TopKGate(8, 6, k=k, min_capacity=2, drop_tokens=drop_tokens)
    mine = ours.TopKGate(8, 6, k=k, min_capacity=2, drop_tokens=drop_tokens)
    mine.load_state_dict(theirs.state_dict())
    x = torch.randn(24, 8, generator=torch.Generator().manual_seed(k))
    logits = torch.randn(24, 6, generator=torch.Generator().manual_seed(k + 10))
    fn = {1: "top1gating", 2: "top2gating", 3: "topkgating"}[k]
    args = (logits, 0.5, 2) if k < 3 else (logits, 3, 0.5, 2)
    for call in (
        lambda m: getattr(m, fn)(
            args[0].clone(), *args[1:], drop_tokens=drop_tokens, sparse_routes=True
        ),
        lambda m: (theirs if m is ds_moe.sharded_moe else mine)(x, None, True, False),
    ):
        torch.manual_seed(1)
        expected = call(ds_moe.sharded_moe)
        torch.manual_seed(1)
        got = call(ours)
        assert len(got) == len(expected) == 7
        assert got[2] == expected[2]  # num_experts, an int
        for i in (0, 1, 3, 4, 5, 6):
            assert got[i].dtype == expected[i].dtype, (i, got[i].dtype, expected[i].dtype)
            torch.testing.assert_close(got[i], expected[i], rtol=1e-6, atol=1e-7)
        assert (got[3] < 0).any() == drop_tokens  # a capacity of 0.5 drops routes


def test_signatures_are_deepspeeds(ds_moe: Any) -> None:
    """Every public callable of deepspeed.moe takes DeepSpeed 0.19.8's parameters, in its
    order, with its defaults (keyword calls written for DeepSpeed bind the same)."""
    import importlib
    import inspect

    from slipstream.moe import layer, utils

    ds_utils = importlib.import_module("deepspeed.moe.utils")
    pairs = [
        (ds_moe.layer.MoE.__init__, layer.MoE.__init__),
        (ds_moe.layer.MoE.forward, layer.MoE.forward),
        (ds_moe.sharded_moe.TopKGate.__init__, ours.TopKGate.__init__),
        (ds_moe.sharded_moe.TopKGate.forward, ours.TopKGate.forward),
        (ds_moe.sharded_moe.MOELayer.__init__, ours.MOELayer.__init__),
        (ds_moe.sharded_moe.top1gating, ours.top1gating),
        (ds_moe.sharded_moe.top2gating, ours.top2gating),
        (ds_moe.sharded_moe.topkgating, ours.topkgating),
    ]
    for name in (
        "split_params_into_different_moe_groups_for_optimizer",
        "is_moe_param",
        "has_moe_layers",
    ):
        pairs.append((getattr(ds_utils, name), getattr(utils, name)))
    for theirs, mine in pairs:
        want = [(p.name, p.default) for p in inspect.signature(theirs).parameters.values()]
        got = [(p.name, p.default) for p in inspect.signature(mine).parameters.values()]
        assert got == want, theirs.__qualname__
