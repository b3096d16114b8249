"""Dense peak FLOP/s of known accelerators, from their vendors' data sheets: the one table.

Both the FLOPs profiler's MFU (``slipstream.profiling.flops``, floor 3) and the planner's
built-in hardware profiles (``slipstream.planner.hardware``, floor 10) read it, so it lives
here, on the accelerator's floor, which both may import. Numbers are per device as
``torch`` counts devices (one MI250X module is two devices, its GCDs) and without
structured sparsity.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DATA_SHEETS", "DataSheet", "data_sheet", "data_sheet_peak"]


@dataclass(frozen=True)
class DataSheet:
    """One accelerator's dense peaks."""

    name: str
    """The fragment of the device name (``torch.cuda.get_device_name``) that identifies it."""
    peaks: dict[torch.dtype, float]
    """Dense peak FLOP/s per device by dtype (bf16/fp16: tensor cores; fp32: vector units)."""
    source: str
    """Where the numbers come from."""


DATA_SHEETS: tuple[DataSheet, ...] = (
    DataSheet(
        "H200",
        {torch.bfloat16: 989e12, torch.float16: 989e12, torch.float32: 67e12},
        "NVIDIA H200 data sheet, SXM: 1,979 TFLOPS BF16/FP16 with sparsity = 989 dense; "
        "67 TFLOPS FP32",
    ),
    DataSheet(
        "H100",
        {torch.bfloat16: 989e12, torch.float16: 989e12, torch.float32: 67e12},
        "NVIDIA H100 Tensor Core GPU data sheet, H100 SXM: 1,979 TFLOPS BF16 with sparsity = "
        "989 dense; 67 TFLOPS FP32",
    ),
    DataSheet(
        "H800",
        {torch.bfloat16: 989e12, torch.float16: 989e12, torch.float32: 67e12},
        "NVIDIA H800 SXM: the H100 SXM's compute (989 TFLOPS BF16/FP16 dense, 67 FP32)",
    ),
    DataSheet(
        "A100",
        {torch.bfloat16: 312e12, torch.float16: 312e12, torch.float32: 19.5e12},
        "NVIDIA A100 Tensor Core GPU data sheet (2021): 312 TFLOPS BF16/FP16 dense; "
        "19.5 TFLOPS FP32",
    ),
    DataSheet(
        "L40S",
        {torch.bfloat16: 362e12, torch.float16: 362e12, torch.float32: 91.6e12},
        "NVIDIA L40S data sheet: 733 TFLOPS BF16/FP16 with sparsity = 362 dense; 91.6 TFLOPS FP32",
    ),
    DataSheet(
        "MI250X",
        {torch.bfloat16: 191.5e12, torch.float16: 191.5e12, torch.float32: 23.95e12},
        "AMD Instinct MI250X data sheet: 383 TFLOPS FP16/BF16 and 47.9 TFLOPS FP32 (vector) "
        "per module of 2 GCDs, halved per GCD (torch sees each GCD as a device); 191.5 is the "
        "peak implied by Dash et al.'s 38.38% = 73.5 TFLOPS per GCD",
    ),
    DataSheet(
        "V100",
        {torch.float16: 125e12, torch.float32: 15.7e12},
        "NVIDIA V100 SXM2 data sheet: 125 TFLOPS FP16 tensor, 15.7 TFLOPS FP32",
    ),
)
"""Matched in order against the device name: the first entry whose ``name`` it contains."""


def data_sheet(device_name: str) -> DataSheet | None:
    """The data sheet of the accelerator ``device_name`` names (``"NVIDIA H100 80GB HBM3"``,
    or just ``"H100"``), None when none is known."""
    return next((s for s in DATA_SHEETS if s.name in device_name), None)


def data_sheet_peak(device_name: str, dtype: torch.dtype) -> float | None:
    """Dense peak FLOP/s of ``device_name`` in ``dtype``; None when unknown."""
    sheet = data_sheet(device_name)
    return None if sheet is None else sheet.peaks.get(dtype)
