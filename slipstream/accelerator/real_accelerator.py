"""Which accelerator ``get_accelerator()`` returns: ``DS_ACCELERATOR``, else CUDA, else CPU."""

from __future__ import annotations

import os

import torch

from slipstream._logging import logger
from slipstream.accelerator.torch_accelerator import TorchAccelerator

__all__ = [
    "SUPPORTED",
    "get_accelerator",
    "is_current_accelerator_supported",
    "refuse_device",
    "set_accelerator",
]

SUPPORTED = ("cuda", "cpu")
"""Device types slipstream runs on; DeepSpeed's others (xpu, npu, hpu, mps, mlu) are refused."""

_current: TorchAccelerator | None = None


def refuse_device(name: str) -> None:
    """Raise the error for a device type slipstream does not run on.

    Raises:
        ValueError: always, naming ``name`` and the supported types.
    """
    raise ValueError(
        f"accelerator {name!r}: slipstream runs on {' or '.join(SUPPORTED)} only; set "
        "DS_ACCELERATOR=cpu, or unset it to pick CUDA when present, else the CPU"
    )


def _detect() -> str:
    """``DS_ACCELERATOR`` as DeepSpeed reads it, else CUDA when present, else CPU."""
    name = os.environ.get("DS_ACCELERATOR")
    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name not in SUPPORTED:
        raise ValueError(
            f"DS_ACCELERATOR={name!r}: slipstream runs on {' or '.join(SUPPORTED)}; unset the "
            "variable to pick CUDA when present, else the CPU"
        )
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "DS_ACCELERATOR='cuda' but torch sees no CUDA device (torch.cuda.is_available() is "
            "False): install a CUDA build of torch or set DS_ACCELERATOR=cpu"
        )
    return name


def get_accelerator() -> TorchAccelerator:
    """The accelerator of this process, chosen once (DeepSpeed's ``get_accelerator``)."""
    global _current
    if _current is None:
        _current = TorchAccelerator(_detect())
        logger.debug("accelerator: %s", _current.device_name())
    return _current


def set_accelerator(accel: TorchAccelerator) -> None:
    """Use ``accel`` from now on (DeepSpeed's ``set_accelerator``)."""
    global _current
    if not isinstance(accel, TorchAccelerator):
        raise TypeError(
            f"set_accelerator({type(accel).__name__}): pass a slipstream TorchAccelerator, "
            "e.g. TorchAccelerator('cpu')"
        )
    _current = accel


def is_current_accelerator_supported() -> bool:
    """Whether the current accelerator is one slipstream runs on (always, once chosen)."""
    return get_accelerator().device_name() in SUPPORTED
