"""CPU kernel choice for half-precision weights: bf16/fp16 GEMMs computed in fp32.

On x86 CPUs without native bf16 instructions (no AVX512-BF16 / AMX), oneDNN emulates a
bf16 GEMM, and it runs slower than the fp32 GEMM of the same shape: measured on this
project's AVX2 machine, a [16, 576] x [576, 1536] product took 2.97 ms in bf16 against
0.52 ms in fp32, and SmolLM2-135M decoding at batch 16 ran at 15.5 tokens/s in bf16 against
41.7 tokens/s with the GEMMs below (docs/inference.md). A matrix-vector product (one row,
memory-bound) is not slower in bf16, so the switch happens at ``min_rows``.

``fp32_gemm_for_half_weights_`` keeps the weights in bf16 (half the memory, and the
``state_dict`` unchanged) and computes products with at least ``min_rows`` rows as
``linear(x.float(), W.float())`` rounded back to the activation dtype. The product of two
bf16 numbers is exact in fp32 and both kernels accumulate in fp32, so the results differ
from the native bf16 GEMM only in summation order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Fp32GemmLinear", "fp32_gemm_for_half_weights_", "native_half_gemm"]

_HALF = (torch.bfloat16, torch.float16)


def native_half_gemm() -> bool:
    """Whether this CPU has bf16 matrix instructions (AVX512-BF16 or AMX tiles)."""
    cpu = getattr(torch._C, "_cpu", None)
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(cpu, name, lambda: False)()) for name in checks)


class Fp32GemmLinear(nn.Linear):
    """An ``nn.Linear`` with bf16/fp16 weights whose multi-row products run in fp32.

    Swapped in by class (``module.__class__``), so parameters, names and hooks are the
    original module's. Costs one fp32 copy of the weight per call, freed after it.
    """

    min_rows: int = 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() < self.min_rows * x.shape[-1] or self.weight.dtype not in _HALF:
            return F.linear(x, self.weight, self.bias)
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)


def fp32_gemm_for_half_weights_(model: nn.Module, min_rows: int = 4) -> int:
    """Swap every plain ``nn.Linear`` of ``model`` holding half-precision weights on the CPU
    to :class:`Fp32GemmLinear`, in place. Returns how many were swapped."""
    swapped = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if type(module) is not nn.Linear or not isinstance(weight, torch.Tensor):
            continue
        if weight.dtype in _HALF and weight.device.type == "cpu":
            module.__class__ = Fp32GemmLinear
            setattr(module, "min_rows", min_rows)  # noqa: B010 (typed as Module here)
            swapped += 1
    return swapped
