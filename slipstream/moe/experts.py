"""The local experts of an MoE layer: copies of one expert module, each marked as an expert.

Expert parameters carry DeepSpeed's marks (``allreduce = False``, ``group_name`` naming the
expert-parallel size), which ``slipstream.moe.utils.is_moe_param`` and the optimizer-group
splitter read, and which tell the gradient reduction to average them over the
expert-data-parallel group instead of the whole data-parallel group.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from slipstream.moe.grouped import grouped_mm

__all__ = ["Experts", "GroupedForward", "mark_expert_params", "register_grouped_expert"]

GroupedForward = Callable[[Sequence[nn.Module], Tensor, Tensor], Tensor | None]
"""``fn(experts, rows, counts)``: all of ``experts`` (one class) applied to their blocks of
``rows`` (``counts[i]`` rows for expert ``i``) at once, or None when this instance does not fit
the grouped form (the experts then run one by one)."""

_GROUPED: dict[type[nn.Module], GroupedForward] = {}


def register_grouped_expert(cls: type[nn.Module], fn: GroupedForward) -> None:
    """Run copies of expert class ``cls`` with ``fn`` (stacked weights, grouped GEMMs)
    instead of one module call per expert. ``fn`` must equal the per-expert loop."""
    _GROUPED[cls] = fn


_ACTIVATIONS: dict[type[nn.Module], Callable[[Tensor], Tensor]] = {
    nn.GELU: F.gelu,
    nn.ReLU: F.relu,
    nn.SiLU: F.silu,
    nn.Tanh: torch.tanh,
}


def _linear_grouped(layers: Sequence[nn.Module], rows: Tensor, counts: Tensor) -> Tensor:
    linears = [cast(nn.Linear, layer) for layer in layers]
    out = grouped_mm(rows, torch.stack([layer.weight for layer in linears]).transpose(1, 2), counts)
    if linears[0].bias is not None:
        bias = torch.stack([cast(Tensor, layer.bias) for layer in linears])
        group = torch.repeat_interleave(torch.arange(len(layers), device=rows.device), counts)
        out = out + bias[group]
    return out


def _sequential_grouped(
    experts: Sequence[nn.Module], rows: Tensor, counts: Tensor
) -> Tensor | None:
    """``Sequential(Linear, activation, Linear)`` experts as two grouped GEMMs."""
    first = experts[0]
    kinds = [type(m) for m in first]  # type: ignore[attr-defined]
    if len(kinds) != 3 or kinds[0] is not nn.Linear or kinds[2] is not nn.Linear:
        return None
    act = _ACTIVATIONS.get(kinds[1])
    if act is None or (kinds[1] is nn.GELU and first[1].approximate != "none"):  # type: ignore[index]
        return None
    h = act(_linear_grouped([e[0] for e in experts], rows, counts))  # type: ignore[index]
    return _linear_grouped([e[2] for e in experts], h, counts)  # type: ignore[index]


register_grouped_expert(nn.Sequential, _sequential_grouped)


def mark_expert_params(module: nn.Module, group_name: str | None) -> None:
    """Mark every parameter of ``module`` as an expert parameter of ``group_name``."""
    for p in module.parameters():
        p.allreduce = False  # type: ignore[attr-defined]
        p.group_name = group_name  # type: ignore[attr-defined]


class Experts(nn.Module):
    """``num_local_experts`` independent deep copies of ``expert``.

    ``forward`` takes ``[..., num_local_experts * c, model_dim]`` chunks along dim 1 as
    DeepSpeed's does; the MoE layer calls :meth:`run` with each expert's own tokens instead.
    """

    def __init__(
        self, expert: nn.Module, num_local_experts: int = 1, expert_group_name: str | None = None
    ) -> None:
        super().__init__()
        self.deepspeed_experts = nn.ModuleList(
            [copy.deepcopy(expert) for _ in range(num_local_experts)]
        )
        self.num_local_experts = num_local_experts
        for e in self.deepspeed_experts:
            mark_expert_params(e, expert_group_name)

    def run(self, i: int, tokens: Tensor) -> Tensor:
        """Local expert ``i`` applied to ``tokens [n, model_dim]`` (a bias output is ignored)."""
        out = self.deepspeed_experts[i](tokens)
        return out[0] if isinstance(out, tuple) else out

    def run_grouped(self, rows: Tensor, counts: list[int]) -> Tensor:
        """Expert ``i`` on ``counts[i]`` consecutive rows of ``rows`` (every expert runs,
        an empty block included, so each has a gradient)."""
        fn = _GROUPED.get(type(self.deepspeed_experts[0]))
        # On CPU the per-expert loop measured faster than stacking the weights every step
        # for a grouped GEMM (docs/moe.md); accelerators take the grouped form.
        if fn is not None and rows.device.type != "cpu" and self.num_local_experts > 1:
            out = fn(list(self.deepspeed_experts), rows, torch.tensor(counts, device=rows.device))
            if out is not None:
                return out
        return torch.cat([self.run(i, block) for i, block in enumerate(rows.split(counts))])

    def forward(self, inputs: Tensor) -> Tensor:
        chunks = inputs.chunk(self.num_local_experts, dim=1)
        return torch.cat([self.run(i, c) for i, c in enumerate(chunks)], dim=1)
