"""Pipeline parallelism: ``PipelineModule`` (layers split into stages), schedules (GPipe,
1F1B, interleaved 1F1B). The engine that runs them, ``PipelineEngine`` (``train_batch``/
``eval_batch``), lives beside ``Engine`` in ``slipstream.runtime.pipeline_engine``; the GPT's
pipeline layers live beside the GPT in ``slipstream.models.gpt_pipeline``.

``slipstream.initialize(model=PipelineModule(...), config=...)`` builds the pipeline engine;
the ``pipeline`` config block picks the schedule. ``slipstream.pipe`` re-exports the
DeepSpeed names.
"""

from slipstream.parallel.pipeline.module import (
    LayerSpec,
    PipelineError,
    PipelineModule,
    TiedLayerSpec,
    partition_balanced,
    partition_uniform,
)
from slipstream.parallel.pipeline.schedule import (
    Instruction,
    Schedule,
    ScheduleError,
    Timeline,
    build_schedule,
    simulate,
    theoretical_bubble,
)

__all__ = [
    "Instruction",
    "LayerSpec",
    "PipelineError",
    "PipelineModule",
    "Schedule",
    "ScheduleError",
    "TiedLayerSpec",
    "Timeline",
    "build_schedule",
    "partition_balanced",
    "partition_uniform",
    "simulate",
    "theoretical_bubble",
]
