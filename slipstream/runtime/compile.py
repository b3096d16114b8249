"""``engine.compile()``: ``torch.compile`` applied where it pays, with ZeRO's hooks left eager.

DeepSpeed's ``engine.compile(backend, compile_kwargs)`` compiles the whole module. slipstream
compiles each block of the model's repeated stack instead (the ``nn.ModuleList`` of
transformer layers: ``GPT.layers``, a Hugging Face model's ``model.layers``), the recipe
torchtitan uses: the blocks share one compiled graph, so compilation costs one block rather
than the depth of the model, and what runs between blocks (the embedding, ZeRO-3's gather and
release hooks, the engine's gradient hooks) stays eager. Only the blocks' ``forward`` is
compiled, not ``__call__``, so module hooks never enter a graph. A model without such a stack
has its own ``forward`` compiled.

The math is the module's; inductor may reorder floating-point operations, so results match
eager within rounding, not bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from slipstream.config import ConfigError

__all__ = ["compile_module_", "repeated_blocks"]


def repeated_blocks(module: nn.Module) -> list[nn.Module]:
    """The blocks of ``module``'s largest ``nn.ModuleList`` of one class (at least two
    members), in order; empty if there is none."""
    best: list[nn.Module] = []
    for child in module.modules():
        if isinstance(child, nn.ModuleList) and len(child) >= 2:
            kinds = {type(m) for m in child}
            if len(kinds) == 1 and len(child) > len(best):
                best = list(child)
    return best


def compile_module_(
    module: nn.Module, backend: str | Callable[..., Any], compile_kwargs: Mapping[str, Any]
) -> str:
    """Compile ``module``'s repeated blocks (or, without any, the module) in place.

    Returns what was compiled, for the log line. Raises ``ConfigError`` for compile options
    that would change what is compiled rather than how (``backend`` inside ``compile_kwargs``).
    """
    kwargs = dict(compile_kwargs)
    if "backend" in kwargs:
        raise ConfigError(
            f"engine.compile(compile_kwargs={{'backend': {kwargs['backend']!r}, ...}}): pass "
            "the backend as engine.compile(backend=...), not inside compile_kwargs"
        )
    blocks = repeated_blocks(module)
    targets = blocks or [module]
    for target in targets:
        # An instance attribute shadows the class's forward; nn.Module.__call__ runs the
        # hooks, then this compiled function.
        target.forward = torch.compile(target.forward, backend=backend, **kwargs)  # type: ignore[method-assign]
    if blocks:
        return f"{len(blocks)} {type(blocks[0]).__name__} blocks"
    return f"the whole {type(module).__name__}"
