"""Guidance schedules and selective guidance: bit-exact invariants and branch skipping."""

from __future__ import annotations

import pytest
import torch

from slipstream.diffusion import (
    ConstantGuidance,
    CustomGuidance,
    DDIMSampler,
    DDPMSampler,
    DPMSolverPP2MSampler,
    GuidedDenoiser,
    NoiseSchedule,
    SelectiveGuidance,
    guided_sample,
    mean_pairwise_distance,
)
from tests.diffusion._toys import CallCounter, GaussianMixtureDenoiser, tiny_unet

SCHEDULE = NoiseSchedule()
NULL = torch.tensor([10])
SAMPLERS = [
    lambda n: DDIMSampler(SCHEDULE, n),
    lambda n: DDPMSampler(SCHEDULE, n),
    lambda n: DPMSolverPP2MSampler(SCHEDULE, n),
]


def _inputs(b: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(b, 1, 8, 8, generator=gen), torch.arange(b) % 10


def _plain_cfg(unet, labels, scale):
    """Textbook CFG, written independently of GuidedDenoiser: both branches, one batch."""

    def model_fn(step, x, t):
        both = unet(torch.cat([x, x]), torch.cat([t, t]), torch.cat([NULL.expand(len(x)), labels]))
        eps_u, eps_c = both.chunk(2)
        return eps_u + scale * (eps_c - eps_u)

    return model_fn


@pytest.mark.parametrize("make", SAMPLERS, ids=["ddim", "ddpm", "dpmpp_2m"])
def test_selective_with_f0_equals_plain_cfg_bit_for_bit(make) -> None:
    """SelectiveGuidance(fraction=0) reproduces a hand-written CFG loop exactly, for every sampler."""
    unet, (noise, labels) = tiny_unet(), _inputs()
    sampler = make(6)
    with torch.no_grad():
        ref = sampler.sample(_plain_cfg(unet, labels, 4.0), noise, torch.Generator().manual_seed(1))
    out = guided_sample(
        unet,
        sampler,
        noise,
        labels,
        NULL,
        SelectiveGuidance(4.0, 0.0),
        generator=torch.Generator().manual_seed(1),
    )
    assert torch.equal(out.samples, ref)
    assert out.stats.modes == ["both"] * 6


@pytest.mark.parametrize("make", SAMPLERS, ids=["ddim", "ddpm", "dpmpp_2m"])
def test_scale_one_makes_every_schedule_identical(make) -> None:
    """With guidance scale 1 every schedule gives bit-identical samples from conditional-only steps."""
    unet, (noise, labels) = tiny_unet(), _inputs()
    schedules = [
        ConstantGuidance(1.0),
        SelectiveGuidance(1.0, 0.2),
        SelectiveGuidance(1.0, 0.5, "first"),
        CustomGuidance([1.0] * 5),
    ]
    outs = [
        guided_sample(
            unet, make(5), noise, labels, NULL, s, generator=torch.Generator().manual_seed(2)
        )
        for s in schedules
    ]
    for out in outs:
        assert torch.equal(out.samples, outs[0].samples)
        assert out.stats.batch_sizes == [4] * 5 and out.stats.modes == ["cond"] * 5


def test_skipped_steps_run_one_branch_counted_by_forward_hook() -> None:
    """Skipping the last 20% of 10 steps runs 8 forwards of 2B rows, then 2 of B: (2 - f) N B rows."""
    unet, (noise, labels) = tiny_unet(), _inputs(3)
    seen: list[tuple[int, list[int]]] = []
    unet.register_forward_hook(
        lambda m, args, out: seen.append((args[0].shape[0], args[2].tolist()))
    )
    out = guided_sample(
        unet, DDIMSampler(SCHEDULE, 10), noise, labels, NULL, SelectiveGuidance(3.0, 0.2)
    )
    assert [b for b, _ in seen] == [6] * 8 + [3] * 2
    assert all(lab == [10, 10, 10, *labels.tolist()] for _, lab in seen[:8])
    assert all(lab == labels.tolist() for _, lab in seen[8:])
    assert out.stats.calls == 10 and out.stats.rows == round((2 - 0.2) * 10 * 3)
    assert out.stats.modes == ["both"] * 8 + ["cond"] * 2


def test_first_fraction_schedule_skips_the_early_steps() -> None:
    """where='first' runs the conditional branch alone in the first ceil(f N) steps."""
    counter = CallCounter(tiny_unet())
    noise, labels = _inputs(2)
    guided_sample(
        counter,
        DDIMSampler(SCHEDULE, 10),
        noise,
        labels,
        NULL,
        SelectiveGuidance(3.0, 0.3, "first"),
    )
    assert counter.batch_sizes == [2] * 3 + [4] * 7


def test_scale_zero_runs_only_the_unconditional_branch() -> None:
    """A step with scale 0 evaluates only the null-label branch (its B rows carry the null label)."""
    unet, (noise, labels) = tiny_unet(), _inputs(2)
    conds: list[list[int]] = []
    unet.register_forward_hook(lambda m, args, out: conds.append(args[2].tolist()))
    out = guided_sample(
        unet, DDIMSampler(SCHEDULE, 3), noise, labels, NULL, CustomGuidance([0.0, 2.0, 1.0])
    )
    assert conds == [[10, 10], [10, 10, 0, 1], [0, 1]]
    assert out.stats.modes == ["uncond", "both", "cond"]


def test_unbatched_branches_agree_with_batched() -> None:
    """batched=False runs two B-row forwards per guided step and gives the same samples (to fp error)."""
    unet, (noise, labels) = tiny_unet(), _inputs(3)
    a = guided_sample(unet, DDIMSampler(SCHEDULE, 4), noise, labels, NULL, ConstantGuidance(3.0))
    b = guided_sample(
        unet, DDIMSampler(SCHEDULE, 4), noise, labels, NULL, ConstantGuidance(3.0), batched=False
    )
    assert b.stats.batch_sizes == [3] * 8 and a.stats.batch_sizes == [6] * 4
    torch.testing.assert_close(a.samples, b.samples, rtol=1e-4, atol=1e-4)


def test_guidance_changes_samples_and_skipping_late_matters_less_than_early() -> None:
    """Exact-score Gaussian mixture: skipping the last 20% deviates far less from CFG than the first 20%."""
    means = torch.tensor([[2.0, 0.0], [-1.0, 1.7], [-1.0, -1.7]])
    denoiser = GaussianMixtureDenoiser(SCHEDULE, means)
    gen = torch.Generator().manual_seed(0)
    noise = torch.randn(400, 2, generator=gen, dtype=torch.float64)
    labels, null = torch.arange(400) % 3, torch.tensor([3])

    def run(schedule):
        return guided_sample(
            denoiser, DDIMSampler(SCHEDULE, 50), noise, labels, null, schedule
        ).samples

    full = run(ConstantGuidance(7.5))
    dev = {
        name: mean_pairwise_distance(run(s), full)
        for name, s in {
            "last20": SelectiveGuidance(7.5, 0.2),
            "last50": SelectiveGuidance(7.5, 0.5),
            "first20": SelectiveGuidance(7.5, 0.2, "first"),
            "none": ConstantGuidance(1.0),
        }.items()
    }
    assert dev["last20"] < 1e-3 * dev["first20"]
    assert dev["last20"] < dev["last50"] < dev["none"]
    assert 0.05 < dev["first20"] < dev["none"]


def test_schedule_and_input_errors_name_the_problem() -> None:
    """Bad fractions, wrong-length custom schedules and mismatched cond rows raise clear errors."""
    with pytest.raises(ValueError, match=r"fraction must be in \[0, 1\], got 1.5"):
        SelectiveGuidance(3.0, 1.5)
    with pytest.raises(ValueError, match="where must be 'last' or 'first'"):
        SelectiveGuidance(3.0, 0.2, "middle")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="finite"):
        ConstantGuidance(float("nan"))
    noise, labels = _inputs(2)
    with pytest.raises(
        ValueError, match=r"CustomGuidance.scales has 2 entries but the sampler runs 3"
    ):
        guided_sample(
            tiny_unet(), DDIMSampler(SCHEDULE, 3), noise, labels, NULL, CustomGuidance([2.0, 2.0])
        )
    with pytest.raises(
        ValueError, match=r"cond must have a leading batch dimension of 2 .* got shape \(3,\)"
    ):
        guided_sample(tiny_unet(), DDIMSampler(SCHEDULE, 3), noise, torch.arange(3), NULL)
    with pytest.raises(TypeError, match="scale\\(step, num_steps\\)"):
        GuidedDenoiser(tiny_unet(), labels, NULL, 3.0, 3)  # type: ignore[arg-type]


def test_selective_schedule_counts_ceil_of_fraction() -> None:
    """ceil(f N) steps are skipped: f=0.2 of 50 -> 10, f=0.5 of 25 -> 13, f=1 -> all."""

    def skipped(s, n):
        return sum(s.scale(i, n) == 1.0 for i in range(n))

    assert skipped(SelectiveGuidance(5.0, 0.2), 50) == 10
    assert skipped(SelectiveGuidance(5.0, 0.5), 25) == 13
    assert skipped(SelectiveGuidance(5.0, 1.0), 7) == 7
    assert [SelectiveGuidance(5.0, 0.2).scale(i, 10) for i in (7, 8, 9)] == [5.0, 1.0, 1.0]
