"""Serving: the step-driven engine interface, a static-batching engine behind it, and the
OpenAI-compatible HTTP server ``slipstream serve`` runs (docs/inference.md, "Serving").

::

    from slipstream.inference.serving import ServeOptions, StaticBatchingEngine, build_app
    app = build_app(StaticBatchingEngine(model), tokenizer, ServeOptions(model_name="tiny"))
    uvicorn.run(app)                                    # or: slipstream serve MODEL_DIR

The HTTP part needs the ``serve`` extra (Starlette, uvicorn); it is imported only when
``build_app`` or ``ServeOptions`` is asked for, so the engines work without it.
"""

from __future__ import annotations

import importlib
from typing import Any

from slipstream.inference.serving.protocol import GenerationEngine, RequestOutput, SamplingParams
from slipstream.inference.serving.static import StaticBatchingEngine

__all__ = [
    "GenerationEngine",
    "RequestOutput",
    "SamplingParams",
    "ServeOptions",
    "StaticBatchingEngine",
    "build_app",
]

_HTTP = {"ServeOptions", "build_app"}


def __getattr__(name: str) -> Any:
    if name in _HTTP:
        return getattr(importlib.import_module("slipstream.inference.serving.app"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
