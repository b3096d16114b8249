"""Pipeline parallelism: ``PipelineModule`` (layers split into stages), schedules (GPipe,
1F1B, interleaved 1F1B) and ``PipelineEngine`` (``train_batch``/``eval_batch``).

``slipstream.initialize(model=PipelineModule(...), config=...)`` builds the pipeline engine;
the ``pipeline`` config block picks the schedule. ``slipstream.pipe`` re-exports the
DeepSpeed names.
"""

from slipstream.parallel.pipeline.engine import ActivationStats, PipelineEngine
from slipstream.parallel.pipeline.module import (
    LayerSpec,
    PipelineError,
    PipelineModule,
    TiedLayerSpec,
    partition_balanced,
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
    "ActivationStats",
    "Instruction",
    "LayerSpec",
    "PipelineEngine",
    "PipelineError",
    "PipelineModule",
    "Schedule",
    "ScheduleError",
    "TiedLayerSpec",
    "Timeline",
    "build_schedule",
    "partition_balanced",
    "simulate",
    "theoretical_bubble",
]
