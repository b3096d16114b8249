"""Lion: evolved sign momentum (Chen et al., 2023, arXiv:2302.06675, Algorithm 2).

Per step, with decoupled weight decay::

    c = b1 m + (1 - b1) g
    w = w * (1 - lr * weight_decay) - lr * sign(c)
    m = b2 m + (1 - b2) g

Every coordinate moves by exactly ``lr`` (or 0), so Lion wants a 3-10x smaller lr and a
3-10x larger weight decay than AdamW (paper section 3.2).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim import Optimizer

from slipstream.optim.lamb import _restore_fp32_states, _state_dtype

__all__ = ["Lion"]


class Lion(Optimizer):
    """Lion optimizer, as in the module docstring.

    Args:
        params: parameters or parameter groups.
        lr: learning rate (float or 0-dim tensor).
        betas: ``(b1, b2)``: interpolation for the update direction and momentum decay, each in
            [0, 1). The paper's default (0.9, 0.99); DeepSpeed's ``FusedLion`` uses (0.9, 0.999),
            which ``build_optimizer("Lion", ...)`` applies for config compatibility.
        weight_decay: decoupled decay, ``w *= 1 - lr * weight_decay``.

    Memory: one state tensor per parameter, fp32 for bf16/fp16 params (4 bytes per element);
    the arithmetic runs in the state dtype and the result is rounded into the parameter.

    Raises:
        ValueError: a hyperparameter is out of range.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
    ) -> None:
        if float(lr) < 0.0:
            raise ValueError(f"Lion: lr must be >= 0, got {lr}")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Lion: betas must be two values in [0, 1), got {betas}")
        if weight_decay < 0.0:
            raise ValueError(f"Lion: weight_decay must be >= 0, got {weight_decay}")
        defaults = dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay)
        super().__init__(params, defaults)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load as ``torch.optim.Optimizer`` does, keeping fp32 states of bf16/fp16 params."""
        super().load_state_dict(state_dict)
        _restore_fp32_states(self, state_dict)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Apply one Lion update to every parameter that has a gradient.

        Raises:
            RuntimeError: a gradient is sparse.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lion does not support sparse gradients")
                dtype = _state_dtype(p)
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(
                        p, dtype=dtype, memory_format=torch.preserve_format
                    )
                m = state["exp_avg"]
                g = p.grad.to(dtype)
                w = p if p.dtype == dtype else p.to(dtype)
                direction = m.lerp(g, 1.0 - beta1).sign_()
                if wd != 0.0:
                    w.mul_(1.0 - lr * wd)
                w.sub_(direction.mul_(lr))
                m.lerp_(g, 1.0 - beta2)
                if w is not p:
                    p.copy_(w)
        return loss
