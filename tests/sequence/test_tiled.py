"""Tiled MLP, tiled logits+loss and sequence_tiled_compute equal the untiled computation in fp64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from slipstream.sequence.tiling import TiledFusedLogitsLoss, TiledMLP, sequence_tiled_compute

TOL = dict(rtol=1e-12, atol=1e-12)  # fp64: chunking changes only the summation order


class _MLP(nn.Module):
    def __init__(self, h: int = 8, i: int = 24) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _grads(module: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    return [x.grad.clone()] + [p.grad.clone() for p in module.parameters()]  # type: ignore[union-attr]


def _run(
    module: nn.Module, x: torch.Tensor, fn, weight: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    module.zero_grad()
    x = x.detach().requires_grad_()
    out = fn(module, x)
    (out * weight).sum().backward()
    return out.detach(), _grads(module, x)


@pytest.mark.parametrize("shards", [1, 3, 7])
def test_tiled_mlp_equals_plain_mlp_fp64(shards: int) -> None:
    """TiledMLP output and x/weight gradients equal the plain MLP's (uneven chunks, batch 2)."""
    torch.manual_seed(0)
    mlp = _MLP().double()
    x = torch.randn(2, 11, 8, dtype=torch.float64)
    w = torch.randn(2, 11, 8, dtype=torch.float64)
    ref_out, ref = _run(mlp, x, lambda m, t: m(t), w)
    out, got = _run(mlp, x, lambda m, t: TiledMLP.apply(lambda s, c: s(c), m, t, shards, None), w)
    torch.testing.assert_close(out, ref_out, **TOL)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, **TOL)


def test_tiled_mlp_refuses_a_parameter_it_was_not_given() -> None:
    """A trainable tensor outside compute_params and `self` is an error, not a lost gradient."""
    mlp = _MLP().double()
    extra = nn.Parameter(torch.ones(8, dtype=torch.float64))
    x = torch.randn(1, 4, 8, dtype=torch.float64, requires_grad=True)
    out = TiledMLP.apply(lambda s, c: s(c) * extra, mlp, x, 2, None)
    with pytest.raises(ValueError, match="neither in compute_params"):
        out.sum().backward()


def _ce_sum(head: nn.Module, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(h), y, ignore_index=-100, reduction="sum")


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_tiled_fused_logits_loss_equals_cross_entropy_fp64(reduction: str) -> None:
    """Loss and hidden/lm_head gradients equal F.cross_entropy over the full logits (with -100s)."""
    torch.manual_seed(1)
    head = nn.Linear(8, 50, bias=False).double()
    h = torch.randn(2, 12, 8, dtype=torch.float64)
    y = torch.randint(0, 50, (2, 12))
    y[0, :5] = -100
    shards = 4 if reduction == "sum" else 3  # "mean" is the mean of per-chunk values

    def plain(m: nn.Module, t: torch.Tensor) -> torch.Tensor:
        if reduction == "sum":
            return _ce_sum(m, t.reshape(-1, 8), y.reshape(-1))
        chunks = zip(t.reshape(-1, 8).chunk(shards), y.reshape(-1).chunk(shards))
        return torch.stack([_ce_sum(m, a, b) for a, b in chunks]).mean()

    def tiled(m: nn.Module, t: torch.Tensor) -> torch.Tensor:
        return TiledFusedLogitsLoss.apply(_ce_sum, m, t, y, None, shards, None, reduction)

    one = torch.tensor(2.5, dtype=torch.float64)  # an upstream gradient != 1 (loss scaling)
    ref_out, ref = _run(head, h, plain, one)
    out, got = _run(head, h, tiled, one)
    torch.testing.assert_close(out, ref_out, **TOL)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, **TOL)


def test_sequence_tiled_compute_loss_and_elementwise_fp64() -> None:
    """DeepSpeed's generic helper: a summed loss (output_unshard_dimension=0) and a joined
    [B, S, H] output both equal the untiled function, gradients included."""
    torch.manual_seed(2)
    head = nn.Linear(8, 30, bias=False).double()
    h = torch.randn(1, 10, 8, dtype=torch.float64)
    y = torch.randint(0, 30, (1, 10))

    def loss_fn(
        hidden_states: torch.Tensor, shift_labels: torch.Tensor, model: nn.Module
    ) -> torch.Tensor:
        return _ce_sum(model, hidden_states.reshape(-1, 8), shift_labels.reshape(-1))

    def tiled(m: nn.Module, t: torch.Tensor) -> torch.Tensor:
        return sequence_tiled_compute(
            loss_fn,
            10,
            3,
            {"hidden_states": t, "shift_labels": y},
            {"model": m},
            "hidden_states",
            [m.weight],
            output_unshard_dimension=0,
            output_reduction="sum",
        )

    one = torch.tensor(1.0, dtype=torch.float64)
    ref_out, ref = _run(head, h, lambda m, t: loss_fn(t, y, m), one)
    out, got = _run(head, h, tiled, one)
    torch.testing.assert_close(out, ref_out, **TOL)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, **TOL)

    w = torch.randn(1, 10, 30, dtype=torch.float64)

    def joined(m: nn.Module, t: torch.Tensor) -> torch.Tensor:
        return sequence_tiled_compute(
            lambda hidden_states: m(hidden_states),
            10,
            4,
            {"hidden_states": t},
            {},
            "hidden_states",
            [m.weight],
            output_reduction=None,
        )

    ref_out, ref = _run(head, h, lambda m, t: m(t), w)
    out, got = _run(head, h, joined, w)
    torch.testing.assert_close(out, ref_out, **TOL)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, **TOL)
