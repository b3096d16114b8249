"""``deepspeed.accelerator.mlu_accelerator``: DeepSpeed's Cambricon MLU accelerator, which slipstream
refuses: it runs on CUDA and the CPU only (``DS_ACCELERATOR=mlu`` is refused the same way).
The class exists so that imports of it keep working; building one raises."""

from __future__ import annotations

from slipstream.accelerator.real_accelerator import refuse_device

__all__ = ["MLU_Accelerator"]


class MLU_Accelerator:
    """Refused at construction (see the module docstring)."""

    def __init__(self) -> None:
        refuse_device("mlu")
