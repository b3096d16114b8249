"""Pipeline schedules as data: the simulated bubble equals theory, 1F1B bounds in-flight
micro-batches, interleaving cuts the bubble by the virtual-stage factor, exports, errors."""

from __future__ import annotations

import json

import pytest

from slipstream.parallel.pipeline import (
    Instruction,
    Schedule,
    ScheduleError,
    build_schedule,
    simulate,
    theoretical_bubble,
)

COSTS = [(1.0, 2.0), (1.0, 1.0), (2.0, 3.0)]


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", [1, 2, 4])
@pytest.mark.parametrize("f,b", COSTS)
def test_bubble_equals_theory(kind: str, p: int, f: float, b: float) -> None:
    """(p - 1) / (m + p - 1) for every micro-batch count, whatever the f/b ratio."""
    for m in range(1, 11):
        timeline = simulate(build_schedule(kind, p, m), f, b)
        assert timeline.bubble_fraction() == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
        assert timeline.makespan == pytest.approx((m + p - 1) * (f + b))


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("v", [2, 3])
def test_interleaving_divides_the_bubble_by_v(p: int, v: int) -> None:
    """Interleaved 1F1B: (p - 1) / (v m + p - 1), i.e. the ramp shrinks v-fold."""
    for m in range(p, 4 * p + 1, p):
        for f, b in COSTS:
            timeline = simulate(build_schedule("interleaved", p, m, v), f, b)
            want = (p - 1) / (v * m + p - 1)
            assert timeline.bubble_fraction() == pytest.approx(want, abs=1e-12)
            assert want == theoretical_bubble("interleaved", p, m, v)
            plain = simulate(build_schedule("1f1b", p, m), f, b).bubble_fraction()
            assert timeline.bubble_fraction() < plain


def test_1f1b_bounds_activations_gpipe_does_not() -> None:
    """At m >> p, 1F1B keeps at most p - s micro-batches alive on stage s, GPipe all m."""
    p, m = 4, 16
    ofob = simulate(build_schedule("1f1b", p, m))
    gpipe = simulate(build_schedule("gpipe", p, m))
    assert ofob.peak_in_flight == [p - s for s in range(p)]
    assert gpipe.peak_in_flight == [m] * p
    # interleaved holds more chunks than 1F1B but far fewer than all v m of them
    inter = simulate(build_schedule("interleaved", p, m, 2))
    assert all(p <= x < 2 * m for x in inter.peak_in_flight)


def test_instruction_order_1f1b() -> None:
    """Stage s: p - s - 1 warm-up forwards, then one forward one backward, then the drain."""
    sched = build_schedule("1f1b", 3, 4)
    compute = [(x.op[0], x.micro_batch) for x in sched.steps[0] if x.op in ("forward", "backward")]
    assert compute == [
        ("f", 0), ("f", 1), ("f", 2), ("b", 0), ("f", 3), ("b", 1), ("b", 2), ("b", 3)
    ]  # fmt: skip
    last = [x.op for x in sched.steps[2]]
    assert last[:3] == ["recv_act", "forward", "backward"]  # no warm-up on the last stage
    assert "send_act" not in last and "recv_grad" not in last


def test_exports() -> None:
    """The text chart has one row per stage and the bubble; the Chrome trace one event per
    compute step, on one thread per stage."""
    p, m, v = 2, 4, 2
    timeline = simulate(build_schedule("interleaved", p, m, v))
    text = timeline.to_text(width=60).splitlines()
    assert len(text) == 1 + p and f"bubble={timeline.bubble_fraction():.3f}" in text[0]
    assert all(line.startswith(f"stage {s}: ") for s, line in enumerate(text[1:]))
    events = json.loads(timeline.to_chrome_trace())["traceEvents"]
    assert len(events) == 2 * p * m * v
    assert {e["tid"] for e in events} == set(range(p))
    assert {e["cat"] for e in events} == {"forward", "backward"}


def test_deadlock_is_detected() -> None:
    """A stage waiting for a gradient before sending the activation it depends on."""
    bad = Schedule(
        "custom",
        2,
        1,
        1,
        (
            (
                Instruction("forward", 0),
                Instruction("recv_grad", 0),
                Instruction("send_act", 0),
                Instruction("backward", 0),
            ),
            (
                Instruction("recv_act", 0),
                Instruction("forward", 0),
                Instruction("backward", 0),
                Instruction("send_grad", 0),
            ),
        ),
    )
    with pytest.raises(ScheduleError, match="deadlocks: stage 0 waits at recv_grad"):
        simulate(bad)


def test_bad_requests() -> None:
    with pytest.raises(ScheduleError, match="multiple of the pipeline stages"):
        build_schedule("interleaved", 4, 6, 2)
    with pytest.raises(ScheduleError, match="use 'interleaved'"):
        build_schedule("1f1b", 2, 4, 2)
    with pytest.raises(ScheduleError, match="unknown pipeline schedule 'zb'"):
        build_schedule("zb", 2, 4)
    with pytest.raises(ScheduleError, match=">= 1"):
        build_schedule("1f1b", 2, 0)
