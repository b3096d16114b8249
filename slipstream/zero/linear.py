"""``deepspeed.runtime.zero.linear``: a linear layer whose backward reads the weight again.

DeepSpeed's ZeRO-3 ships a linear autograd function that saves the weight *parameter* (not a
gathered copy) for backward and, should the parameter be released by then, gathers it for the
backward and releases it after. slipstream's ZeRO-3 releases a parameter by pointing it at an
empty placeholder and gathers it again before the unit's backward (:mod:`.param`), so a saved
parameter sees its values again in backward; :class:`LinearFunctionForZeroStage3` does what
DeepSpeed's does on top of that: a weight still released when its backward runs (it was used
outside its module, e.g. inside a ``GatheredParameters`` block that has ended) has its unit
gathered for the backward (collective over the data-parallel group, as DeepSpeed's
``all_gather``); the store releases the unit once its gradients are reduced, as for any unit
gathered for backward (not at once: the weight's gradient is accumulated after this function
returns, at the weight's full shape).

The gradients are ``nn.functional.linear``'s (the same matrix products), for inputs of any
rank (1-D included) and with or without a bias; under autocast the backward runs in the
forward's autocast state, as ``torch.amp.custom_bwd`` would.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from slipstream._logging import logger
from slipstream.zero.param import ZeroParamStatus, is_zero_param
from slipstream.zero.sharded_store import unit_owner

__all__ = ["LinearFunctionForZeroStage3", "LinearModuleForZeroStage3", "zero3_linear_wrap"]


def _gather_if_released(weight: torch.Tensor) -> None:
    """Gather ``weight``'s ZeRO-3 unit for the backward if it is released.

    Raises:
        RuntimeError: ``weight`` is partitioned but not by a ZeRO-3 engine (a ``zero.Init``
            model before ``initialize``): nothing would receive its gradient.
    """
    if not is_zero_param(weight) or weight.ds_status is not ZeroParamStatus.NOT_AVAILABLE:  # type: ignore[attr-defined]
        return
    owner = unit_owner(weight)
    if owner is None:
        raise RuntimeError(
            "zero3_linear_wrap: backward reached a weight partitioned by zero.Init outside a "
            "ZeRO-3 engine; pass the model to deepspeed.initialize before training it"
        )
    owner.store.gather(owner.unit, "bwd")


class LinearFunctionForZeroStage3(torch.autograd.Function):
    """``y = x @ weight.T + bias`` saving ``weight`` itself for backward (DeepSpeed's names)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(  # type: ignore[override]
        input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if input.dim() == 2 and bias is not None:
            return torch.addmm(bias, input, weight.t())
        out = input.matmul(weight.t())
        return out + bias if bias is not None else out

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        input, weight = inputs[0], inputs[1]
        bias = inputs[2] if len(inputs) > 2 else None
        device_type = weight.device.type
        ctx.autocast = (device_type, torch.is_autocast_enabled(device_type))
        ctx.autocast_dtype = torch.get_autocast_dtype(device_type)
        ctx.save_for_backward(input, weight, bias)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_output: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        input, weight, bias = ctx.saved_tensors
        device_type, enabled = ctx.autocast
        _gather_if_released(weight)
        with torch.autocast(device_type=device_type, enabled=enabled, dtype=ctx.autocast_dtype):
            return _linear_grads(ctx.needs_input_grad, grad_output, input, weight, bias)


def _linear_grads(
    needs: tuple[bool, ...],
    grad_output: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor | None, ...]:
    """The input, weight and bias gradients of ``input @ weight.T + bias``."""
    grad_input = grad_weight = grad_bias = None
    if needs[0]:
        grad_input = grad_output.matmul(weight)
    if needs[1]:
        if grad_output.dim() == 1:
            grad_weight = grad_output.unsqueeze(-1) * input.unsqueeze(0)
        else:
            flat_out = grad_output.reshape(-1, grad_output.shape[-1])
            grad_weight = flat_out.t().matmul(input.reshape(-1, input.shape[-1]))
    if bias is not None and len(needs) > 2 and needs[2]:
        if grad_output.dim() == 1:
            grad_bias = grad_output
        else:
            grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0)
    return grad_input, grad_weight, grad_bias


def zero3_linear_wrap(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``nn.functional.linear(input, weight, bias)`` through :class:`LinearFunctionForZeroStage3`."""
    out: torch.Tensor = LinearFunctionForZeroStage3.apply(input, weight, bias)
    return out


class LinearModuleForZeroStage3(nn.Module):
    """``nn.Linear`` computed by :func:`zero3_linear_wrap`: the same parameters (``weight`` of
    shape ``(out_features, in_features)``, optional ``bias``), the same initialisation and the
    same outputs and gradients."""

    __constants__ = ["in_features", "out_features"]

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        logger.debug("building LinearModuleForZeroStage3(%d, %d)", in_features, out_features)
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialisation: uniform in +-1/sqrt(in_features)."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0.0
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return zero3_linear_wrap(input, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}"
        )
