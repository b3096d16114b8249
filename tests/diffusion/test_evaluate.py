"""compare_schedules / time_schedules: shared noise, per-schedule rows, baseline deviation zero."""

from __future__ import annotations

import torch

from slipstream.diffusion import (
    ConstantGuidance,
    DDIMSampler,
    DigitClassifier,
    NoiseSchedule,
    SelectiveGuidance,
)
from slipstream.diffusion.evaluate import compare_schedules, time_schedules
from tests.diffusion._toys import tiny_unet


def test_compare_and_time_schedules_report_rows_accuracy_distance_and_times() -> None:
    """The baseline has deviation 0 and 2NB rows; skipping half the steps costs 1.5NB rows."""
    unet, clf = tiny_unet(), DigitClassifier().eval()
    noise = torch.randn(12, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    labels, null = torch.arange(12) % 10, torch.tensor([10])
    schedules = {"cfg": ConstantGuidance(3.0), "last50": SelectiveGuidance(3.0, 0.5)}
    sampler = DDIMSampler(NoiseSchedule(), 4, clip_denoised=1.0)
    reference = torch.rand(20, 1, 8, 8) * 2 - 1
    reports = compare_schedules(unet, sampler, schedules, noise, labels, null, clf, reference)
    assert [r.name for r in reports] == ["cfg", "last50"]
    assert reports[0].rows == 2 * 4 * 12 and reports[1].rows == 6 * 12
    assert reports[0].deviation == 0.0 and reports[1].deviation > 0.0
    assert all(0.0 <= r.accuracy <= 1.0 and r.feature_distance >= 0.0 for r in reports)
    assert all(r.samples.abs().max() <= 1.0 for r in reports)
    times = time_schedules(unet, sampler, schedules, noise, labels, null, rounds=3)
    assert {k: len(v) for k, v in times.items()} == {"cfg": 3, "last50": 3}
    assert all(t > 0 for v in times.values() for t in v)


def test_benchmark_goal_check_reports_met_and_not_met() -> None:
    """The benchmark's goal lines say 'met' only when savings, accuracy and first-vs-last hold."""
    from benchmarks.selective_guidance import check_goals
    from slipstream.diffusion.evaluate import ScheduleReport

    def rep(name: str, acc: float, fd: float, dev: float) -> ScheduleReport:
        return ScheduleReport(name, torch.zeros(1), 0, acc, fd, dev)

    reports = [
        rep("full CFG", 1.0, 10.0, 0.0),
        rep("last 20%", 0.995, 10.0, 0.4),
        rep("last 50%", 0.96, 9.0, 1.0),
        rep("first 20%", 0.99, 12.0, 1.5),
    ]
    times = {"full CFG": [10.0], "last 20%": [9.0], "last 50%": [8.0], "first 20%": [9.0]}
    lines = check_goals(reports, times)
    assert "time saved 10.0%" in lines[0] and "-> met; accuracy drop +0.5 pt" in lines[0]
    assert "time saved 20.0%" in lines[1] and "NOT met; accuracy drop +4.0 pt" in lines[1]
    assert lines[1].endswith("NOT met")
    assert "(3.8x)" in lines[2] and lines[2].endswith("first is measurably worse (met)")
    reports[3] = rep("first 20%", 0.999, 12.0, 1.5)  # better accuracy than last 20%: not worse
    assert check_goals(reports, times)[2].endswith("NOT measurably worse")
