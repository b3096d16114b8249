"""Pipeline schedules as plain data: per-stage instruction lists, a timeline simulator and
its bubble, text and Chrome-trace exports. Nothing here touches processes or tensors.

Notation: ``p`` stages, ``v`` model chunks per stage (virtual stages), ``m`` micro-batches.
Local chunk ``c`` of stage ``s`` is model chunk ``k = c p + s``; ``F(i, k)`` needs
``F(i, k-1)``, ``B(i, k)`` needs ``F(i, k)`` and ``B(i, k+1)``.

* **GPipe** (Huang et al. 2019): all forwards, then all backwards; ``m`` micro-batches'
  activations live at once.
* **1F1B** (PipeDream-Flush, Narayanan et al. 2021, sec. 2.1): stage ``s`` runs
  ``min(p - s - 1, m)`` warm-up forwards, then alternates one forward and one backward, then
  drains the remaining backwards; at most ``p - s`` micro-batches live at once.
* **Interleaved 1F1B** (Narayanan et al. 2021, sec. 2.2): the same on ``v`` chunks per stage,
  micro-batches taken in groups of ``p`` per chunk, so ``m`` must be a multiple of ``p``.

Bubble, with a stage's forward costing ``f`` and its backward ``b`` (a chunk costs ``f/v``
and ``b/v``) and free communication, the timeline of :func:`simulate` gives exactly
(pinned by tests)::

    GPipe, 1F1B:     makespan = (m + p - 1)(f + b)       bubble = (p - 1) / (m + p - 1)
    interleaved:     makespan = (m + (p - 1)/v)(f + b)   bubble = (p - 1) / (v m + p - 1)

where bubble = idle time / (p x makespan): the ramp-up and drain of ``p - 1`` stage steps, cut
``v``-fold by interleaving because a chunk step is ``1/v`` of a stage step. Both hold for every
``m`` (interleaved: ``m`` a multiple of ``p``, as the schedule requires) and any ``f``, ``b``.
GPipe over ``v > 1`` chunks (chunk by chunk, all micro-batches each) reaches the interleaved
bubble too, holding all ``v m`` chunk activations; interleaved 1F1B holds far fewer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "OPS",
    "Instruction",
    "Schedule",
    "ScheduleError",
    "Timeline",
    "build_schedule",
    "simulate",
    "theoretical_bubble",
]

Op = Literal["forward", "backward", "send_act", "recv_act", "send_grad", "recv_grad"]
OPS: tuple[str, ...] = ("forward", "backward", "send_act", "recv_act", "send_grad", "recv_grad")


class ScheduleError(ValueError):
    """An invalid schedule request (e.g. micro-batches not a multiple of stages for the
    interleaved schedule) or a schedule that would deadlock."""


@dataclass(frozen=True)
class Instruction:
    """One step of a stage: ``op`` on micro-batch ``micro_batch`` of local chunk ``chunk``.

    ``send_act``/``recv_act`` move the chunk's output / input activations, ``send_grad`` /
    ``recv_grad`` the gradient of its input / output.
    """

    op: Op
    micro_batch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.op}(mb={self.micro_batch}, chunk={self.chunk})"


@dataclass(frozen=True)
class Schedule:
    """Instruction lists of every stage (index = stage id)."""

    kind: str
    stages: int
    micro_batches: int
    virtual_stages: int
    steps: tuple[tuple[Instruction, ...], ...]

    def model_chunk(self, stage: int, chunk: int) -> int:
        return chunk * self.stages + stage

    def peer(self, stage: int, ins: Instruction) -> int:
        """The stage ``ins`` (a send or receive) talks to."""
        k = self.model_chunk(stage, ins.chunk)
        other = k + 1 if ins.op in ("send_act", "recv_grad") else k - 1
        return other % self.stages

    def peer_chunk(self, stage: int, ins: Instruction) -> int:
        k = self.model_chunk(stage, ins.chunk)
        other = k + 1 if ins.op in ("send_act", "recv_grad") else k - 1
        return other // self.stages


def _compute_order(kind: str, p: int, v: int, m: int, s: int) -> list[Instruction]:
    """Forwards and backwards of stage ``s`` in execution order."""
    if kind == "gpipe":
        fwd = [Instruction("forward", i, c) for c in range(v) for i in range(m)]
        bwd = [Instruction("backward", i, c) for c in reversed(range(v)) for i in range(m)]
        return fwd + bwd
    if kind == "1f1b":
        warm = min(p - s - 1, m)
        out = [Instruction("forward", i, 0) for i in range(warm)]
        for i in range(m - warm):
            out += [Instruction("forward", warm + i, 0), Instruction("backward", i, 0)]
        out += [Instruction("backward", i, 0) for i in range(m - warm, m)]
        return out
    # Interleaved: virtual step j takes micro-batch (j // (p v)) p + j % p on chunk
    # (j // p) % v for forwards, v - 1 - that for backwards.
    total = m * v

    def unit(j: int, backward: bool) -> Instruction:
        c = (j // p) % v
        i = (j // (p * v)) * p + j % p
        return Instruction("backward" if backward else "forward", i, v - 1 - c if backward else c)

    warm = total if m == p else min((p - s - 1) * 2 + (v - 1) * p, total)
    out = [unit(j, False) for j in range(warm)]
    for j in range(total - warm):
        out += [unit(warm + j, False), unit(j, True)]
    out += [unit(j, True) for j in range(total - warm, total)]
    return out


def _with_comm(order: list[Instruction], p: int, v: int, s: int) -> list[Instruction]:
    last = p * v - 1
    out: list[Instruction] = []
    for ins in order:
        k = ins.chunk * p + s
        if ins.op == "forward":
            if k > 0:
                out.append(Instruction("recv_act", ins.micro_batch, ins.chunk))
            out.append(ins)
            if k < last:
                out.append(Instruction("send_act", ins.micro_batch, ins.chunk))
        else:
            if k < last:
                out.append(Instruction("recv_grad", ins.micro_batch, ins.chunk))
            out.append(ins)
            if k > 0:
                out.append(Instruction("send_grad", ins.micro_batch, ins.chunk))
    return out


def build_schedule(
    kind: str, stages: int, micro_batches: int, virtual_stages: int = 1, forward_only: bool = False
) -> Schedule:
    """Per-stage instruction lists for ``kind`` in {"gpipe", "1f1b", "interleaved"}.

    ``forward_only``: forwards only, micro-batch by micro-batch (evaluation).

    Raises:
        ScheduleError: bad sizes, an unknown kind, ``virtual_stages`` not matching the kind,
            or interleaving with ``micro_batches`` not a multiple of ``stages``.
    """
    p, v, m = stages, virtual_stages, micro_batches
    if p < 1 or v < 1 or m < 1:
        raise ScheduleError(
            f"pipeline schedule needs stages, virtual_stages and micro_batches >= 1 (got "
            f"{p}, {v}, {m})"
        )
    if kind not in ("gpipe", "1f1b", "interleaved"):
        raise ScheduleError(
            f"unknown pipeline schedule {kind!r}: use '1f1b', 'gpipe' or 'interleaved'"
        )
    if kind == "1f1b" and v != 1:
        raise ScheduleError(
            f"schedule '1f1b' runs one chunk per stage, got virtual_stages={v}: use "
            "'interleaved' (or 'gpipe') for several chunks"
        )
    if kind == "interleaved" and not forward_only and m % p:
        raise ScheduleError(
            f"the interleaved schedule needs the number of micro-batches "
            f"(gradient_accumulation_steps = {m}) to be a multiple of the pipeline stages "
            f"({p}): set gradient_accumulation_steps to {p * max(1, round(m / p))} or use "
            "schedule '1f1b'"
        )
    steps = []
    for s in range(p):
        if forward_only:
            order = [Instruction("forward", i, c) for i in range(m) for c in range(v)]
        else:
            order = _compute_order(kind, p, v, m, s)
        steps.append(tuple(_with_comm(order, p, v, s)))
    return Schedule(kind, p, m, v, tuple(steps))


# --------------------------------------------------------------------------- timeline
@dataclass
class Timeline:
    """Simulated execution: per stage, ``(start, end, instruction)`` of each compute step.

    Attributes:
        makespan: time of the last step's end.
        peak_in_flight: per stage, the most micro-batch chunks whose forward ran and whose
            backward has not (activations held) at any moment.
    """

    schedule: Schedule
    forward_cost: float
    backward_cost: float
    events: list[list[tuple[float, float, Instruction]]] = field(default_factory=list)
    peak_in_flight: list[int] = field(default_factory=list)

    @property
    def makespan(self) -> float:
        return max((e[1] for stage in self.events for e in stage), default=0.0)

    def busy(self, stage: int) -> float:
        return sum(end - start for start, end, _ in self.events[stage])

    def bubble_fraction(self) -> float:
        """Idle time over total time, summed over stages: 1 - busy / (p x makespan)."""
        span = self.makespan
        if span == 0:
            return 0.0
        p = self.schedule.stages
        return 1.0 - sum(self.busy(s) for s in range(p)) / (p * span)

    def to_text(self, width: int = 100) -> str:
        """An ASCII chart: one row per stage, forwards as the micro-batch digit (mod 10),
        backwards as a letter (a = 0), idle as '.'."""
        span = self.makespan
        scale = width / span if span > 0 else 1.0
        lines = [
            f"{self.schedule.kind}: p={self.schedule.stages} v={self.schedule.virtual_stages} "
            f"m={self.schedule.micro_batches} f={self.forward_cost} b={self.backward_cost} "
            f"bubble={self.bubble_fraction():.3f}"
        ]
        for s, stage in enumerate(self.events):
            row = ["."] * max(1, round(span * scale))
            for start, end, ins in stage:
                i = ins.micro_batch
                ch = str(i % 10) if ins.op == "forward" else chr(ord("a") + i % 26)
                for x in range(
                    round(start * scale), max(round(end * scale), round(start * scale) + 1)
                ):
                    if x < len(row):
                        row[x] = ch
            lines.append(f"stage {s}: " + "".join(row))
        return "\n".join(lines)

    def to_chrome_trace(self) -> str:
        """Chrome trace JSON (chrome://tracing, Perfetto): one thread per stage, 1 unit = 1 ms."""
        events = []
        for s, stage in enumerate(self.events):
            for start, end, ins in stage:
                events.append(
                    {
                        "name": f"{ins.op[0].upper()}{ins.micro_batch}"
                        + (f".c{ins.chunk}" if self.schedule.virtual_stages > 1 else ""),
                        "cat": ins.op,
                        "ph": "X",
                        "ts": start * 1000.0,
                        "dur": (end - start) * 1000.0,
                        "pid": 0,
                        "tid": s,
                        "args": {"micro_batch": ins.micro_batch, "chunk": ins.chunk},
                    }
                )
        return json.dumps({"traceEvents": events, "displayTimeUnit": "ms"})


def simulate(schedule: Schedule, forward_cost: float = 1.0, backward_cost: float = 2.0) -> Timeline:
    """Run ``schedule`` on a model of the hardware: each stage executes its instructions in
    order; a chunk's forward costs ``forward_cost / v`` and its backward ``backward_cost / v``;
    sends are asynchronous and free; a receive waits for its matching send.

    Also validates the schedule: every (micro-batch, chunk) is run forward once and backward
    at most once (after its forward), every send has its receive, and nothing deadlocks.

    Raises:
        ScheduleError: a missing or duplicated step, or a deadlock (naming the stuck stages).
    """
    p, v, m = schedule.stages, schedule.virtual_stages, schedule.micro_batches
    _check_steps(schedule)
    f, b = forward_cost / v, backward_cost / v
    sent: dict[tuple[str, int, int], float] = {}  # (kind, micro_batch, model chunk) -> time
    pc = [0] * p
    clock = [0.0] * p
    events: list[list[tuple[float, float, Instruction]]] = [[] for _ in range(p)]
    live = [0] * p
    peak = [0] * p
    progressed = True
    while progressed:
        progressed = False
        for s in range(p):
            steps = schedule.steps[s]
            while pc[s] < len(steps):
                ins = steps[pc[s]]
                k = schedule.model_chunk(s, ins.chunk)
                if ins.op in ("send_act", "send_grad"):
                    kind = "act" if ins.op == "send_act" else "grad"
                    sent[(kind, ins.micro_batch, k)] = clock[s]
                elif ins.op in ("recv_act", "recv_grad"):
                    kind = "act" if ins.op == "recv_act" else "grad"
                    src = k - 1 if kind == "act" else k + 1
                    key = (kind, ins.micro_batch, src)
                    if key not in sent:
                        break
                    clock[s] = max(clock[s], sent[key])
                else:
                    cost = f if ins.op == "forward" else b
                    events[s].append((clock[s], clock[s] + cost, ins))
                    clock[s] += cost
                    live[s] += 1 if ins.op == "forward" else -1
                    peak[s] = max(peak[s], live[s])
                pc[s] += 1
                progressed = True
    stuck = [s for s in range(p) if pc[s] < len(schedule.steps[s])]
    if stuck:
        detail = "; ".join(f"stage {s} waits at {schedule.steps[s][pc[s]]}" for s in stuck)
        raise ScheduleError(f"pipeline schedule {schedule.kind!r} deadlocks: {detail}")
    del m
    return Timeline(schedule, forward_cost, backward_cost, events, peak)


def _check_steps(schedule: Schedule) -> None:
    p, v, m = schedule.stages, schedule.virtual_stages, schedule.micro_batches
    for s, steps in enumerate(schedule.steps):
        fwd = [(x.micro_batch, x.chunk) for x in steps if x.op == "forward"]
        bwd = [(x.micro_batch, x.chunk) for x in steps if x.op == "backward"]
        want = {(i, c) for i in range(m) for c in range(v)}
        if sorted(fwd) != sorted(want) or (bwd and sorted(bwd) != sorted(want)):
            raise ScheduleError(
                f"stage {s} of schedule {schedule.kind!r} does not run every (micro-batch, "
                "chunk) exactly once forward (and once backward)"
            )
        done: set[tuple[int, int]] = set()
        for x in steps:
            if x.op == "forward":
                done.add((x.micro_batch, x.chunk))
            elif x.op == "backward" and (x.micro_batch, x.chunk) not in done:
                raise ScheduleError(f"stage {s}: {x} comes before its forward")
    del p


def theoretical_bubble(
    kind: str, stages: int, micro_batches: int, virtual_stages: int = 1
) -> float:
    """The bubble :func:`simulate` reproduces (idle / total time) for any ``f``, ``b``:
    ``(p-1)/(v m + p-1)``, i.e. ``(p-1)/(m+p-1)`` for GPipe and 1F1B on one chunk."""
    if kind not in ("gpipe", "1f1b", "interleaved"):
        raise ScheduleError(f"unknown pipeline schedule {kind!r}")
    p, m, v = stages, micro_batches, virtual_stages
    return (p - 1) / (v * m + p - 1)
