"""DeepSpeed's ``deepspeed.pipe`` names: ``from slipstream.pipe import PipelineModule``."""

from slipstream.parallel.pipeline import (
    LayerSpec,
    PipelineEngine,
    PipelineError,
    PipelineModule,
    TiedLayerSpec,
)

__all__ = ["LayerSpec", "PipelineEngine", "PipelineError", "PipelineModule", "TiedLayerSpec"]
