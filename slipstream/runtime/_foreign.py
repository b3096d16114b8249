"""Refuse objects of the real DeepSpeed handed to slipstream's ``initialize``.

``import slipstream as deepspeed`` renames slipstream in one file only: another import in the
same script (``from deepspeed.pipe import PipelineModule``, ``from deepspeed.ops.adam import
FusedAdam``) still loads the real DeepSpeed when it is installed, and its objects would be
trained by slipstream's engine with DeepSpeed's hidden assumptions (its pipeline partitioner,
its compiled kernels, its ZeRO hooks). Nothing would fail; results would quietly differ. So
``initialize`` refuses them by name and says how to get slipstream's, or to set
``SLIPSTREAM_AS_DEEPSPEED=1`` so that every ``deepspeed`` import is slipstream.
"""

from __future__ import annotations

import sys
from typing import Any

from torch import nn

__all__ = ["refuse_real_deepspeed"]

_FIX = (
    "slipstream.initialize cannot train objects of the real DeepSpeed (mixing the two libraries "
    "changes results without an error). Import it from slipstream instead (`import slipstream "
    "as deepspeed` does not rename other imports), or run with SLIPSTREAM_AS_DEEPSPEED=1 so "
    "that every `deepspeed` import is slipstream"
)


def _real_deepspeed_loaded() -> bool:
    module = sys.modules.get("deepspeed")
    return module is not None and not hasattr(module, "__slipstream_version__")


def _from_deepspeed(obj: Any) -> str | None:
    """``module.Class`` when ``obj``'s class is defined by the real DeepSpeed, else None."""
    cls = type(obj)
    mod = getattr(cls, "__module__", "") or ""
    if mod == "deepspeed" or mod.startswith("deepspeed."):
        return f"{mod}.{cls.__qualname__}"
    return None


def refuse_real_deepspeed(model: nn.Module, optimizer: Any, lr_scheduler: Any) -> None:
    """Raise if the model (or a submodule), the optimizer or the scheduler is DeepSpeed's.

    Costs nothing when the real DeepSpeed is not imported in this process.

    Raises:
        TypeError: naming the object, its DeepSpeed class and the fix.
    """
    if not _real_deepspeed_loaded():
        return
    for what, obj in (("optimizer", optimizer), ("lr_scheduler", lr_scheduler)):
        name = _from_deepspeed(obj) if obj is not None else None
        if name is not None:
            raise TypeError(f"{what} is a {name} from the real DeepSpeed: {_FIX}")
    for sub_name, sub in model.named_modules():
        name = _from_deepspeed(sub)
        if name is not None:
            where = f"model.{sub_name}" if sub_name else "model"
            raise TypeError(f"{where} is a {name} from the real DeepSpeed: {_FIX}")
