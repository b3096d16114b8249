"""``deepspeed.runtime.pipe.schedule``: DeepSpeed's pipeline schedules and instructions
(``TrainSchedule``, ``InferenceSchedule``, ``PipeInstruction`` and its kinds). They live in
``slipstream.parallel.pipeline.instructions``."""

from slipstream.parallel.pipeline.instructions import (
    BackwardPass,
    BufferOpInstruction,
    DataParallelSchedule,
    ForwardPass,
    InferenceSchedule,
    LoadMicroBatch,
    OptimizerStep,
    PipeInstruction,
    PipeSchedule,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
    TrainSchedule,
    call_to_str,
)

__all__ = [
    "BackwardPass",
    "BufferOpInstruction",
    "DataParallelSchedule",
    "ForwardPass",
    "InferenceSchedule",
    "LoadMicroBatch",
    "OptimizerStep",
    "PipeInstruction",
    "PipeSchedule",
    "RecvActivation",
    "RecvGrad",
    "ReduceGrads",
    "ReduceTiedGrads",
    "SendActivation",
    "SendGrad",
    "TrainSchedule",
    "call_to_str",
]
