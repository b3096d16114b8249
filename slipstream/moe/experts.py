"""The local experts of an MoE layer: copies of one expert module, each marked as an expert.

Expert parameters carry DeepSpeed's marks (``allreduce = False``, ``group_name`` naming the
expert-parallel size), which ``slipstream.moe.utils.is_moe_param`` and the optimizer-group
splitter read, and which tell the gradient reduction to average them over the
expert-data-parallel group instead of the whole data-parallel group.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

__all__ = ["Experts", "mark_expert_params"]


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
        return torch.cat([self.run(i, block) for i, block in enumerate(rows.split(counts))])

    def forward(self, inputs: Tensor) -> Tensor:
        chunks = inputs.chunk(self.num_local_experts, dim=1)
        return torch.cat([self.run(i, c) for i, c in enumerate(chunks)], dim=1)
