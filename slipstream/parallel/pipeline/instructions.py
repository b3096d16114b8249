"""DeepSpeed's pipeline schedule API (``deepspeed.runtime.pipe.schedule``): a schedule is an
iterable of steps, each step a list of instruction objects for one stage.

Megatron-DeepSpeed and other code written for DeepSpeed subclass ``PipeSchedule`` or walk a
``TrainSchedule`` to see what a stage does when. This module yields the same instruction
streams as DeepSpeed 0.19.8 (checked step by step in tests/compat): the synchronous 1F1B
``TrainSchedule`` in ``2 (m + p - 1)`` steps, ``InferenceSchedule`` in ``m + p - 1`` steps with
two alternating buffers, and ``DataParallelSchedule``. slipstream's ``PipelineEngine`` runs its
own schedules (``slipstream.parallel.pipeline.schedule``); these classes describe DeepSpeed's.

TrainSchedule, as arithmetic: at step ``t`` stage ``s`` runs a forward when ``t + s`` is even,
of micro-batch ``t//2 - s//2``; otherwise a backward of micro-batch ``t//2 - p + 1 + s//2``.
A stage sends what it computed in the previous step (activations downstream after a forward,
gradients upstream after a backward) while it receives for the current one, and the last
step ends with the tied-gradient reduction, the gradient reduction and the optimizer step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

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


def call_to_str(base: str, *args: Any, **kwargs: Any) -> str:
    """``base(arg, ..., key=value, ...)`` with each value's ``repr`` (DeepSpeed's helper)."""
    parts = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"{base}({', '.join(parts)})"


class PipeInstruction:
    """One thing a stage does in a step; keyword arguments become attributes."""

    def __init__(self, **kwargs: Any) -> None:
        self.name = type(self).__name__
        self.kwargs = kwargs
        for key, value in kwargs.items():
            setattr(self, key, value)

    def __repr__(self) -> str:
        return call_to_str(self.name, **self.kwargs)


class OptimizerStep(PipeInstruction):
    """Step the optimizer and zero the gradients (after the reductions)."""


class ReduceGrads(PipeInstruction):
    """Reduce gradients over the stage's data-parallel group."""


class ReduceTiedGrads(PipeInstruction):
    """Reduce the gradients of tied layers over the stages holding them."""


class BufferOpInstruction(PipeInstruction):
    """An instruction on pipeline buffer ``buffer_id``."""

    buffer_id: int

    def __init__(self, buffer_id: int, **kwargs: Any) -> None:
        super().__init__(buffer_id=buffer_id, **kwargs)


class LoadMicroBatch(BufferOpInstruction):
    """Read the next micro-batch into the buffer (first and last stage)."""


class ForwardPass(BufferOpInstruction):
    """Run the stage forward on the buffer's input."""


class BackwardPass(BufferOpInstruction):
    """Run the stage backward from the buffer's output gradient."""


class SendActivation(BufferOpInstruction):
    """Send the buffer's output to the next stage."""


class RecvActivation(BufferOpInstruction):
    """Receive the previous stage's output into the buffer."""


class SendGrad(BufferOpInstruction):
    """Send the gradient of the buffer's input to the previous stage."""


class RecvGrad(BufferOpInstruction):
    """Receive the gradient of the buffer's output from the next stage."""


class PipeSchedule(ABC):
    """Base schedule: subclasses define :meth:`steps` (a generator of instruction lists).

    Args:
        micro_batches: micro-batches per batch.
        stages: pipeline stages.
        stage_id: the stage this schedule is for.
    """

    def __init__(self, micro_batches: int, stages: int, stage_id: int) -> None:
        self.micro_batches = micro_batches
        self.stages = stages
        self.stage_id = stage_id
        self.prev_stage = stage_id - 1
        self.next_stage = stage_id + 1
        self.it: Iterator[list[PipeInstruction]] | None = None

    @abstractmethod
    def steps(self) -> Iterator[list[PipeInstruction]]:
        """The instruction lists of one batch, one per step."""

    def num_pipe_buffers(self) -> int:
        """Buffers the stage needs (default: one per micro-batch)."""
        return self.micro_batches

    def _valid_micro_batch(self, micro_batch_id: int) -> bool:
        return 0 <= micro_batch_id < self.micro_batches

    def _valid_stage(self, stage_id: int) -> bool:
        return 0 <= stage_id < self.stages

    def _buffer_idx(self, micro_batch_id: int) -> int:
        if not self._valid_micro_batch(micro_batch_id):
            raise ValueError(f"micro-batch {micro_batch_id} is outside 0..{self.micro_batches - 1}")
        return micro_batch_id % self.num_pipe_buffers()

    @property
    def stage(self) -> int:
        return self.stage_id

    @property
    def num_stages(self) -> int:
        return self.stages

    @property
    def num_micro_batches(self) -> int:
        return self.micro_batches

    @property
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_id == self.stages - 1

    def __iter__(self) -> PipeSchedule:
        self.it = None
        return self

    def __next__(self) -> list[PipeInstruction]:
        if self.it is None:
            self.it = self.steps()
        return next(self.it)


class InferenceSchedule(PipeSchedule):
    """Forward passes only: micro-batch ``t - s`` at step ``t``, two alternating buffers."""

    def steps(self) -> Iterator[list[PipeInstruction]]:
        even_stage = self.stage_id % 2 == 0
        for step in range(self.micro_batches + self.stages - 1):
            mb = step - self.stage_id
            # Neighbouring stages use the buffers in opposite phase, so a send and a receive
            # in the same step never touch the same buffer.
            recv_buf, send_buf = (
                (step % 2, (step + 1) % 2) if even_stage else ((step + 1) % 2, step % 2)
            )
            cmds: list[PipeInstruction] = []
            if (self.is_first_stage or self.is_last_stage) and self._valid_micro_batch(mb):
                cmds.append(LoadMicroBatch(recv_buf))
            send = self._valid_stage(self.next_stage) and self._valid_micro_batch(mb - 1)
            recv = self._valid_stage(self.prev_stage) and self._valid_micro_batch(mb)
            # Even stages send first and odd stages receive first, so each pair pairs up.
            if even_stage:
                cmds += [SendActivation(send_buf)] if send else []
                cmds += [RecvActivation(recv_buf)] if recv else []
            else:
                cmds += [RecvActivation(recv_buf)] if recv else []
                cmds += [SendActivation(send_buf)] if send else []
            if self._valid_micro_batch(mb):
                cmds.append(ForwardPass(recv_buf))
            yield cmds

    def num_pipe_buffers(self) -> int:
        return 2


class TrainSchedule(PipeSchedule):
    """Synchronous 1F1B training (see the module docstring for the step arithmetic)."""

    def _step_to_micro_batch(self, step: int) -> tuple[int, bool]:
        forward = (step + self.stage_id) % 2 == 0
        if forward:
            return step // 2 - self.stage_id // 2, True
        return step // 2 - self.stages + 1 + self.stage_id // 2, False

    def steps(self) -> Iterator[list[PipeInstruction]]:
        total = 2 * (self.micro_batches + self.stages - 1)
        prev_mb = -1
        for step in range(total):
            mb, forward = self._step_to_micro_batch(step)
            prev_ok, cur_ok = self._valid_micro_batch(prev_mb), self._valid_micro_batch(mb)
            prev_buf = self._buffer_idx(prev_mb) if prev_ok else -1
            cur_buf = self._buffer_idx(mb) if cur_ok else -1
            cmds: list[PipeInstruction] = []
            if forward:
                if prev_ok and self._valid_stage(self.prev_stage):
                    cmds.append(SendGrad(prev_buf))
                if cur_ok and self._valid_stage(self.prev_stage):
                    cmds.append(RecvActivation(cur_buf))
            else:
                if cur_ok and self._valid_stage(self.next_stage):
                    cmds.append(RecvGrad(cur_buf))
                if prev_ok and self._valid_stage(self.next_stage):
                    cmds.append(SendActivation(prev_buf))
            if (self.is_first_stage or self.is_last_stage) and forward and cur_ok:
                cmds.append(LoadMicroBatch(cur_buf))
            if cur_ok:
                cmds.append(ForwardPass(cur_buf) if forward else BackwardPass(cur_buf))
            if step == total - 1:
                cmds += [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
            prev_mb = mb
            yield cmds

    def num_pipe_buffers(self) -> int:
        """Forwards in flight: ``p - s`` (at most ``m``), at least 2."""
        return max(2, min(self.stages - self.stage_id, self.micro_batches))


class DataParallelSchedule(PipeSchedule):
    """Gradient accumulation without pipelining: load, forward, backward per micro-batch."""

    def steps(self) -> Iterator[list[PipeInstruction]]:
        for step in range(self.micro_batches):
            cmds: list[PipeInstruction] = [
                LoadMicroBatch(buffer_id=0),
                ForwardPass(buffer_id=0),
                BackwardPass(buffer_id=0),
            ]
            if step == self.micro_batches - 1:
                cmds += [ReduceGrads(), OptimizerStep()]
            yield cmds

    def num_pipe_buffers(self) -> int:
        return 1
