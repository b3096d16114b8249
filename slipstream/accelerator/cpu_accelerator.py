"""``deepspeed.accelerator.cpu_accelerator``: ``CPU_Accelerator``, slipstream's accelerator on
the CPU (``TorchAccelerator("cpu")``), for code that builds one and passes it to
``set_accelerator``."""

from __future__ import annotations

from slipstream.accelerator.torch_accelerator import TorchAccelerator

__all__ = ["CPU_Accelerator"]


class CPU_Accelerator(TorchAccelerator):
    """The CPU accelerator (what ``get_accelerator()`` is under ``DS_ACCELERATOR=cpu``)."""

    def __init__(self) -> None:
        super().__init__("cpu")
