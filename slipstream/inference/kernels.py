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

``pack_lm_head_`` does the same for the largest product of a decode step, the LM head
(SmolLM2-135M: [49152, 576], a fifth of the weights): it keeps fp32 copies of the head weight
laid out for the CPU kernel that multiplies it fastest, a column-major ``[in, out]`` copy for
one row (batch 1: 4.4 ms against 7.7 ms for ``F.linear`` on this machine) and oneDNN's
packed layout for more rows (batch 16: 20 ms against 29 ms). The copies cost memory (one or
two fp32 copies of the head), are built on first use and rebuilt when the weight changes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "Fp32GemmLinear",
    "PackedHeadLinear",
    "fp32_gemm_for_half_weights_",
    "native_half_gemm",
    "onednn_linear",
    "onednn_linear_available",
    "onednn_pack",
    "pack_lm_head_",
]

_HALF = (torch.bfloat16, torch.float16)


_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def _cpuinfo_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """The first processor's feature flags from ``/proc/cpuinfo`` (empty where unreadable)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def native_half_gemm() -> bool:
    """Whether this CPU has bf16 matrix instructions (AVX512-BF16 or AMX tiles).

    Asked of torch where it answers (``torch._C._cpu._is_avx512_bf16_supported`` and
    ``_is_amx_tile_supported``; torch 2.13 no longer has them), else of the CPU's flags in
    ``/proc/cpuinfo``. Without either answer the CPU counts as emulating bf16."""
    cpu = getattr(torch._C, "_cpu", None)
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    if any(bool(getattr(cpu, name, lambda: False)()) for name in checks):
        return True
    return bool(_cpuinfo_flags() & _BF16_FLAGS)


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


def onednn_linear_available() -> bool:
    """Whether this build of torch has oneDNN's packed linear (``torch.ops.mkldnn``)."""
    return bool(torch.backends.mkldnn.is_available()) and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


def onednn_pack(weight: torch.Tensor, rows: int) -> torch.Tensor | None:
    """``weight`` (fp32 ``[out, in]``) in oneDNN's packed GEMM layout for about ``rows``
    rows, or None where this build of torch has no oneDNN linear (the caller then uses
    ``F.linear``). Multiply with :func:`onednn_linear`."""
    if not onednn_linear_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, rows)
    except RuntimeError:
        return None


def onednn_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` on ``packed`` (:func:`onednn_pack` of ``weight``)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedHeadLinear(nn.Linear):
    """An ``nn.Linear`` (the LM head) whose product runs on cached fp32 copies of its weight,
    laid out per row count: column-major for one row, oneDNN-packed for more.

    Swapped in by class, so the parameter (tied to the embedding or not), its name and the
    ``state_dict`` are unchanged. The copies are keyed on the weight's storage and version
    counter, so an in-place update or a new weight tensor rebuilds them instead of serving
    stale values. With gradients wanted (training) it is a plain ``nn.Linear``. The output
    has the input's dtype, as the plain module's.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if (torch.is_grad_enabled() and weight.requires_grad) or weight.device.type != "cpu":
            return super().forward(x)
        rows = x.numel() // x.shape[-1]
        flat = x.reshape(rows, x.shape[-1]).float()
        if rows == 1:
            out = flat @ self._copy("columns", lambda w: w.t().contiguous())
        else:
            packed = self._copy("onednn", lambda w: onednn_pack(w, rows))
            if packed is None:
                out = F.linear(flat, self._copy("fp32", lambda w: w))
            else:
                out = onednn_linear(flat, packed)
        if self.bias is not None:
            out = out + self.bias.float()
        return out.reshape(*x.shape[:-1], out.shape[-1]).to(x.dtype)

    def _copy(self, layout: str, build: Callable[[torch.Tensor], Any]) -> Any:
        """The weight in ``layout`` (built from its fp32 values by ``build``), cached until
        the weight changes."""
        weight = self.weight
        key = (weight.data_ptr(), weight._version, weight.dtype)
        copies: dict[str, tuple[Any, Any]] = self.__dict__.setdefault("_layouts", {})
        hit = copies.get(layout)
        if hit is None or hit[0] != key:
            with torch.no_grad():
                copies[layout] = (key, build(weight.detach().float()))
        return copies[layout][1]


def pack_lm_head_(model: nn.Module) -> bool:
    """Swap ``model``'s LM head (``get_output_embeddings()`` of a Hugging Face model, the
    ``lm_head`` of slipstream's GPT) to :class:`PackedHeadLinear` when it is a plain (or
    :class:`Fp32GemmLinear`) float linear layer on the CPU. Returns whether it did."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else getattr(model, "lm_head", None)
    if not isinstance(head, nn.Linear) or type(head) not in (nn.Linear, Fp32GemmLinear):
        return False
    weight = head.weight
    if weight.device.type != "cpu" or not weight.is_floating_point():
        return False
    head.__class__ = PackedHeadLinear
    return True
