"""``deepspeed.utils.pin_memory``: which page-locking backend the accelerator uses.

DeepSpeed selects it with ``DS_PIN_MEMORY_BACKEND``: ``torch`` (the default; ``pin_memory``
is torch's, and ``unpin_memory`` is a no-op since torch frees the page-locked memory with
the tensor) or ``native`` (DeepSpeed's compiled ``pin_memory`` op, with its own allocator).
slipstream compiles no ops, so it has only the torch backend: asking for ``native`` raises,
as DeepSpeed does when its op cannot be built (never a silent fallback).
"""

from __future__ import annotations

import os

__all__ = ["BACKEND_ENV", "get_active_native_pinned_memory", "get_native_pinned_memory"]

BACKEND_ENV = "DS_PIN_MEMORY_BACKEND"


def get_native_pinned_memory() -> None:
    """DeepSpeed's native pinned-memory manager, which slipstream does not build.

    Raises:
        RuntimeError: always; name the torch backend instead.
    """
    raise RuntimeError(
        "the native pin_memory backend needs DeepSpeed's compiled pin_memory op, which "
        f"slipstream does not build: unset {BACKEND_ENV} (or set it to 'torch') to pin with torch"
    )


def get_active_native_pinned_memory() -> None:
    """None with the torch backend (the default); with ``DS_PIN_MEMORY_BACKEND=native``,
    :func:`get_native_pinned_memory`'s error.

    Raises:
        RuntimeError: the native backend was selected.
    """
    if os.environ.get(BACKEND_ENV, "torch").strip().lower() != "native":
        return None
    get_native_pinned_memory()
    return None
