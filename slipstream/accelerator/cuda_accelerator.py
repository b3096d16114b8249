"""``deepspeed.accelerator.cuda_accelerator``: ``CUDA_Accelerator``, slipstream's accelerator
on CUDA (``TorchAccelerator("cuda")``), for code that builds one and passes it to
``set_accelerator``."""

from __future__ import annotations

from slipstream.accelerator.torch_accelerator import TorchAccelerator

__all__ = ["CUDA_Accelerator"]


class CUDA_Accelerator(TorchAccelerator):
    """The CUDA accelerator (what ``get_accelerator()`` is when torch sees a GPU)."""

    def __init__(self) -> None:
        super().__init__("cuda")
