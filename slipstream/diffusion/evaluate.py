"""Comparing guidance schedules on one model: time, class accuracy, feature distance, deviation.

Every schedule samples from the *same* initial noise and labels, so differences come from the
schedule alone. Timing runs the schedules interleaved in rounds and keeps the median, which is
what makes ratios trustworthy on a shared machine.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from slipstream.diffusion.guidance import Denoiser, GuidanceSchedule
from slipstream.diffusion.metrics import (
    class_accuracy,
    frechet_distance,
    mean_pairwise_distance,
    sample_features,
)
from slipstream.diffusion.samplers import Sampler, guided_sample

__all__ = ["ScheduleReport", "compare_schedules", "time_schedules"]


@dataclass
class ScheduleReport:
    """One schedule's results.

    Attributes:
        name: the schedule's name.
        samples: the generated samples.
        rows: denoiser rows evaluated (batch size times NFE).
        accuracy: fraction of samples the classifier assigns to their prompt label.
        feature_distance: Fréchet distance to the reference images in classifier features.
        deviation: mean L2 distance to the first schedule's samples (same noise).
        seconds: sampling wall time of every timed round.
    """

    name: str
    samples: torch.Tensor
    rows: int
    accuracy: float
    feature_distance: float
    deviation: float
    seconds: list[float] = field(default_factory=list)

    @property
    def median_seconds(self) -> float:
        return statistics.median(self.seconds) if self.seconds else float("nan")


def compare_schedules(
    denoiser: Denoiser,
    sampler: Sampler,
    schedules: Mapping[str, GuidanceSchedule],
    noise: torch.Tensor,
    labels: torch.Tensor,
    null_cond: torch.Tensor,
    classifier: nn.Module,
    reference: torch.Tensor,
    generator_seed: int = 0,
) -> list[ScheduleReport]:
    """Sample once per schedule and judge the samples (the first schedule is the baseline).

    Args:
        denoiser: the conditional denoiser.
        sampler: the sampler (DDIM, DPM-Solver++, DDPM).
        schedules: name -> schedule, baseline first (deviation is measured against it).
        noise: initial noise ``(N, C, H, W)`` shared by all schedules.
        labels: the prompt labels ``(N,)``.
        null_cond: the unconditional conditioning (one row).
        classifier: judge with ``forward`` (logits) and ``features``.
        reference: real images for the feature distance.
        generator_seed: seed of the stochastic samplers' noise (same for every schedule).
    Returns:
        one :class:`ScheduleReport` per schedule, in order, with one timed round each.
    """
    ref_features = sample_features(classifier, reference)
    reports: list[ScheduleReport] = []
    for name, schedule in schedules.items():
        gen = torch.Generator(device=noise.device).manual_seed(generator_seed)
        start = time.perf_counter()
        out = guided_sample(denoiser, sampler, noise, labels, null_cond, schedule, generator=gen)
        seconds = time.perf_counter() - start
        samples = out.samples.clamp(-1, 1)
        base = reports[0].samples if reports else samples
        reports.append(
            ScheduleReport(
                name=name,
                samples=samples,
                rows=out.stats.rows,
                accuracy=class_accuracy(classifier, samples, labels),
                feature_distance=frechet_distance(
                    sample_features(classifier, samples), ref_features
                ),
                deviation=mean_pairwise_distance(samples, base),
                seconds=[seconds],
            )
        )
    return reports


def time_schedules(
    denoiser: Denoiser,
    sampler: Sampler,
    schedules: Mapping[str, GuidanceSchedule],
    noise: torch.Tensor,
    labels: torch.Tensor,
    null_cond: torch.Tensor,
    rounds: int = 5,
    sync: Callable[[], None] | None = None,
) -> dict[str, list[float]]:
    """Wall time of sampling under each schedule, interleaved over ``rounds`` rounds.

    The order of the schedules rotates each round so that no schedule always runs first.
    ``sync`` (e.g. ``torch.cuda.synchronize``) is called before reading the clock.
    Returns name -> list of seconds.
    """
    names = list(schedules)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            gen = torch.Generator(device=noise.device).manual_seed(0)
            start = time.perf_counter()
            guided_sample(
                denoiser, sampler, noise, labels, null_cond, schedules[name], generator=gen
            )
            if sync is not None:
                sync()
            times[name].append(time.perf_counter() - start)
    return times
