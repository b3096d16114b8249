"""Engine extensions: capabilities from higher floors, attached by ``initialize`` when their
config block is enabled.

The runtime cannot import what sits above it (the hybrid engine needs ``slipstream.inference``
and lives in ``slipstream.rlhf``), so such a capability registers a function here, keyed by
its config block; ``initialize`` calls it on the finished engine. A block that is enabled with
nothing registered is an error, never a silent drop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from slipstream.config import ConfigError

if TYPE_CHECKING:
    from slipstream.runtime.engine import Engine

__all__ = ["EXTENSION_BLOCKS", "apply_engine_extensions", "register_engine_extension"]

EngineExtension = Callable[["Engine"], Any]

EXTENSION_BLOCKS = ("hybrid_engine", "compression_training")
"""Config blocks served by an extension, in the order they are applied."""

_EXTENSIONS: dict[str, EngineExtension] = {}


def register_engine_extension(block: str, apply_: EngineExtension) -> None:
    """Attach ``apply_(engine)`` to every engine whose config enables ``block``."""
    if block not in EXTENSION_BLOCKS:
        raise ValueError(f"register_engine_extension: unknown block {block!r}")
    _EXTENSIONS[block] = apply_


def _enabled(cfg: Any, block: str) -> bool:
    return bool(getattr(getattr(cfg, block, None), "enabled", False))


def apply_engine_extensions(engine: Engine) -> None:
    """Run the registered extension of every enabled block on ``engine``, in block order."""
    for block in EXTENSION_BLOCKS:
        if not _enabled(engine.config, block):
            continue
        if block not in _EXTENSIONS:
            raise ConfigError(
                f"config key '{block}.enabled' is true but nothing provides it: import "
                f"slipstream (the package) so that its '{block}' extension registers"
            )
        _EXTENSIONS[block](engine)
