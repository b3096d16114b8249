"""DeepSpeed's ``deepspeed.pipe`` names: ``from slipstream.pipe import PipelineModule``."""

from slipstream.parallel.pipeline import LayerSpec, PipelineError, PipelineModule, TiedLayerSpec
from slipstream.runtime.pipeline_engine import PipelineEngine

__all__ = ["LayerSpec", "PipelineEngine", "PipelineError", "PipelineModule", "TiedLayerSpec"]
