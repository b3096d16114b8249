"""Inference: ``init_inference`` (DeepSpeed's entry point) and KV-cache generation.

::

    import slipstream
    engine = slipstream.init_inference(model, dtype=torch.bfloat16, max_out_tokens=2048)
    out = engine.generate(input_ids, attention_mask=mask, max_new_tokens=64)
    for tokens in slipstream.inference.stream(engine, input_ids=ids, max_new_tokens=64):
        ...

See docs/inference.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from slipstream.inference import generation
from slipstream.inference.batching import ContinuousBatchingEngine, RequestOutput, SamplingParams
from slipstream.inference.config import InferenceConfig, InferenceTPConfig
from slipstream.inference.engine import InferenceEngine, init_inference
from slipstream.inference.generation import generate
from slipstream.inference.request import call_arguments
from slipstream.models.sampling import SamplingPolicy

__all__ = [
    "ContinuousBatchingEngine",
    "InferenceConfig",
    "InferenceEngine",
    "InferenceTPConfig",
    "RequestOutput",
    "SamplingParams",
    "SamplingPolicy",
    "generate",
    "init_inference",
    "stream",
]


def stream(model: InferenceEngine | nn.Module, *args: Any, **kwargs: Any) -> Iterator[torch.Tensor]:
    """Yield each step's new tokens ``[batch]`` as they are produced.

    ``model`` is an :class:`InferenceEngine` (its limits apply) or a Hugging Face causal LM;
    the other arguments are ``generate``'s. Arguments are checked before this returns.
    """
    if isinstance(model, InferenceEngine):
        return model.stream(*args, **kwargs)
    return generation.stream(model, **call_arguments(args, kwargs))
