"""``deepspeed.OnDevice``: build a module's tensors on a chosen device and dtype."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["OnDevice"]

# The constructors DeepSpeed's OnDevice redirects; modules build their parameters with them
# (nn.Linear, nn.Embedding, LayerNorm use torch.empty/ones/zeros with device=None).
_CONSTRUCTORS: frozenset[Callable[..., Any]] = frozenset(
    {torch.empty, torch.zeros, torch.ones, torch.full}
)


class _DeviceDtypeMode(TorchFunctionMode):
    """Gives the four constructors a default device and casts their floating outputs."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.device, self.dtype = device, dtype

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func not in _CONSTRUCTORS:
            return func(*args, **kwargs)
        if kwargs.get("device") is None:
            kwargs["device"] = self.device
        out = func(*args, **kwargs)
        return out.to(self.dtype) if out.is_floating_point() else out


class OnDevice:
    """Context manager: tensors made by ``torch.empty/zeros/ones/full`` inside it (so the
    parameters and buffers of modules built inside it) land on ``device`` (unless the call
    names one), and floating-point ones are cast to ``dtype``, as DeepSpeed's ``OnDevice``.

    ``OnDevice(dtype=torch.bfloat16, device="meta")`` builds a model without memory; then
    ``model.to_empty(device=...)`` and an initialization or a checkpoint load fill it.

    Args:
        dtype: floating-point dtype of the new tensors.
        device: device for tensors whose constructor names none (default ``"meta"``).
        enabled: False makes the context a no-op.
    """

    def __init__(
        self, dtype: torch.dtype, device: str | torch.device = "meta", enabled: bool = True
    ) -> None:
        self.dtype, self.device, self.enabled = dtype, torch.device(device), enabled
        self._mode: _DeviceDtypeMode | None = None

    def __enter__(self) -> OnDevice:
        if self.enabled:
            self._mode = _DeviceDtypeMode(self.device, self.dtype)
            self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._mode is not None:
            self._mode.__exit__(*exc)
            self._mode = None
