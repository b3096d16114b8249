"""LAMB: Adam moments with a layer-wise trust ratio (You et al., 2019, arXiv:1904.00962).

Each parameter tensor is one "layer". Per step (Algorithm 2 of the paper)::

    m = b1 m + (1 - b1) g            v = b2 v + (1 - b2) g^2
    m_hat = m / (1 - b1^t)           v_hat = v / (1 - b2^t)       (if bias_correction)
    r = m_hat / (sqrt(v_hat) + eps) + weight_decay * w
    trust = clamp(||w|| / ||r||, min_coeff, max_coeff)   (1 when either norm is 0)
    w = w - lr * trust * r

The clamp bounds are DeepSpeed's ``FusedLamb`` ``max_coeff``/``min_coeff``. DeepSpeed's CUDA kernel
differs from the paper in one place: it takes the trust ratio of the *uncorrected* update and
folds the bias correction into the step size afterwards, which scales early steps by
``sqrt(1 - b2^t) / (1 - b1^t)``. slipstream follows the paper.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from itertools import chain
from typing import Any

import torch
from torch.optim import Optimizer

__all__ = ["Lamb"]


def _state_dtype(p: torch.Tensor) -> torch.dtype:
    """Optimizer states of low-precision params are kept in fp32 (float64 params stay float64)."""
    return torch.float32 if p.dtype in (torch.float16, torch.bfloat16) else p.dtype


def _restore_fp32_states(optimizer: Optimizer, state_dict: dict[str, Any]) -> None:
    """Undo ``Optimizer.load_state_dict``'s cast of states to the param dtype for bf16/fp16 params.

    torch casts every floating state tensor to its parameter's dtype on load, which would round
    our fp32 moments of a bf16 parameter to bf16 and break exact resume. Re-copy them from the
    loaded dict at ``_state_dtype``; params whose dtype equals the state dtype are untouched.
    """
    saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
    params = chain.from_iterable(g["params"] for g in optimizer.param_groups)
    for pid, p in zip(saved_ids, params):
        saved = state_dict["state"].get(pid)
        if not saved or _state_dtype(p) == p.dtype:
            continue
        for key, value in saved.items():
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                optimizer.state[p][key] = value.to(p.device, _state_dtype(p), copy=True)


class Lamb(Optimizer):
    """LAMB optimizer (layer-wise adaptive moments), as in the module docstring.

    Args:
        params: parameters or parameter groups.
        lr: learning rate (float or 0-dim tensor).
        betas: decay rates of the first and second moments, each in [0, 1).
        eps: added to ``sqrt(v_hat)`` (or to ``v_hat`` under the root, see ``eps_inside_sqrt``).
        weight_decay: decoupled decay added to the update before the trust ratio.
        bias_correction: divide the moments by ``1 - beta^t`` (DeepSpeed default: True).
        max_coeff: upper clamp of the trust ratio (DeepSpeed default 10.0).
        min_coeff: lower clamp of the trust ratio (DeepSpeed default 0.01).
        eps_inside_sqrt: use ``sqrt(v_hat + eps)`` instead of ``sqrt(v_hat) + eps``
            (DeepSpeed ``FusedLamb`` option).

    Memory: two state tensors per parameter, fp32 for bf16/fp16 params (8 bytes per element);
    the arithmetic runs in the state dtype and the result is rounded into the parameter.
    ``get_lamb_coeffs()`` returns the trust ratios of the last step (one host sync per call).

    Raises:
        ValueError: a hyperparameter is out of range.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        bias_correction: bool = True,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        eps_inside_sqrt: bool = False,
    ) -> None:
        if float(lr) < 0.0:
            raise ValueError(f"Lamb: lr must be >= 0, got {lr}")
        if not all(0.0 <= b < 1.0 for b in betas) or len(betas) != 2:
            raise ValueError(f"Lamb: betas must be two values in [0, 1), got {betas}")
        if eps < 0.0 or weight_decay < 0.0:
            raise ValueError(f"Lamb: eps and weight_decay must be >= 0, got {eps}, {weight_decay}")
        if not 0.0 < min_coeff <= max_coeff:
            raise ValueError(
                f"Lamb: need 0 < min_coeff <= max_coeff, got min_coeff={min_coeff}, "
                f"max_coeff={max_coeff}"
            )
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
            eps_inside_sqrt=eps_inside_sqrt,
        )
        super().__init__(params, defaults)
        self._lamb_coeffs: list[torch.Tensor] = []

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load as ``torch.optim.Optimizer`` does, keeping fp32 states of bf16/fp16 params."""
        super().load_state_dict(state_dict)
        _restore_fp32_states(self, state_dict)

    def get_lamb_coeffs(self) -> list[float]:
        """Trust ratios applied in the last ``step()``, one per updated parameter."""
        return [float(c) for c in self._lamb_coeffs]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Apply one LAMB update to every parameter that has a gradient.

        Raises:
            RuntimeError: a gradient is sparse.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._lamb_coeffs = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lamb does not support sparse gradients")
                self._lamb_coeffs.append(self._update(p, group))
        return loss

    def _update(self, p: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        dtype = _state_dtype(p)
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(
                p, dtype=dtype, memory_format=torch.preserve_format
            )
        state["step"] += 1
        step = state["step"]
        beta1, beta2 = group["betas"]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        g = p.grad.to(dtype)  # type: ignore[union-attr]
        w = p if p.dtype == dtype else p.to(dtype)

        m.lerp_(g, 1.0 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        bc1 = 1.0 - beta1**step if group["bias_correction"] else 1.0
        bc2 = 1.0 - beta2**step if group["bias_correction"] else 1.0
        v_hat = v / bc2
        if group["eps_inside_sqrt"]:
            denom = v_hat.add_(group["eps"]).sqrt_()
        else:
            denom = v_hat.sqrt_().add_(group["eps"])
        update = (m / bc1).div_(denom)
        if group["weight_decay"] != 0.0:
            update.add_(w, alpha=group["weight_decay"])

        # Trust ratio phi(||w||) / ||r|| with phi = clamp (paper eq. 6); stays on device (no sync).
        w_norm = torch.linalg.vector_norm(w)
        u_norm = torch.linalg.vector_norm(update)
        ratio = (w_norm / u_norm).clamp(group["min_coeff"], group["max_coeff"])
        trust = torch.where((w_norm > 0) & (u_norm > 0), ratio, torch.ones_like(ratio))
        w.sub_(update.mul_(trust * group["lr"]))
        if w is not p:
            p.copy_(w)
        return trust
