"""DeepSpeed's ``deepspeed.runtime.zero.partition_parameters`` names, for code that reaches
into that module: the Hugging Face integration does (``prevent_arange_dtype_change`` swaps
``zero_wrapper_for_fp_tensor_constructor`` around ``from_pretrained`` under ZeRO-3).

DeepSpeed's ``Init`` wraps torch's tensor constructors to create tensors in the config's
dtype and on the accelerator. slipstream's ``Init`` wraps no constructor (it replaces each
parameter as a module registers it), so the wrapper factory here returns the constructor
unchanged and swapping it is harmless.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from slipstream.accelerator import get_accelerator
from slipstream.zero.gathered import GatheredParameters, register_external_parameter
from slipstream.zero.init import Init
from slipstream.zero.param import ZeroParamStatus

__all__ = [
    "GatheredParameters",
    "Init",
    "MultipleAllGatherHandles",
    "ZeroParamStatus",
    "get_accelerator",
    "partitioned_param_data_shape",
    "register_external_parameter",
    "zero_wrapper_for_fp_tensor_constructor",
]

_orig_torch_arange = torch.arange
_orig_torch_empty = torch.empty
_orig_torch_zeros = torch.zeros
_orig_torch_ones = torch.ones
_orig_torch_full = torch.full


def zero_wrapper_for_fp_tensor_constructor(
    fn: Callable[..., torch.Tensor], target_fp_dtype: torch.dtype, target_device: Any = None
) -> Callable[..., torch.Tensor]:
    """``fn`` itself: slipstream's ``Init`` leaves tensor constructors alone."""
    return fn


partitioned_param_data_shape = [0]
"""The shape DeepSpeed gives a partitioned parameter's ``.data`` (an empty tensor)."""


class MultipleAllGatherHandles:
    """Waits on several all-gather handles as one (DeepSpeed's), passing
    ``handle_dependency`` to each by keyword."""

    def __init__(self, handles: list[Any]) -> None:
        self.handles = handles

    def wait(self, handle_dependency: bool = True) -> None:
        for handle in self.handles:
            handle.wait(handle_dependency=handle_dependency)
