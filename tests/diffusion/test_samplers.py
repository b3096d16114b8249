"""Samplers and the noise schedule: correctness on exact scores and parity with diffusers."""

from __future__ import annotations

import pytest
import torch

from slipstream.diffusion import (
    DDIMSampler,
    DDPMSampler,
    DPMSolverPP2MSampler,
    NoiseSchedule,
    make_sampler,
)
from tests.diffusion._toys import gaussian_eps

SCHEDULE = NoiseSchedule()


@pytest.mark.parametrize(
    ("name", "coarse", "fine"), [("ddim", 20, 250), ("ddpm", 50, 1000), ("dpmpp_2m", 10, 50)]
)
def test_samplers_converge_to_the_data_distribution_on_the_exact_score(
    name: str, coarse: int, fine: int
) -> None:
    """With the exact ε of N(0, 0.5^2) data, the sample std approaches 0.5 as the steps grow."""
    noise = torch.randn(20000, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    eps = gaussian_eps(SCHEDULE, std=0.5)

    def std(steps: int) -> float:
        sampler = make_sampler(name, SCHEDULE, steps, clip_denoised=None)
        out = sampler.sample(lambda i, x, t: eps(x, t), noise, torch.Generator().manual_seed(1))
        assert abs(float(out.mean())) < 0.02
        return float(out.std())

    coarse_err, fine_err = abs(std(coarse) - 0.5), abs(std(fine) - 0.5)
    assert fine_err < 0.01
    assert fine_err < coarse_err


def test_ddim_is_deterministic_and_eta_adds_noise() -> None:
    """DDIM eta=0 ignores the generator; eta=1 draws from it (different seeds, different samples)."""
    eps = gaussian_eps(SCHEDULE)
    noise = torch.randn(8, 2, generator=torch.Generator().manual_seed(0))

    def run(eta: float, seed: int) -> torch.Tensor:
        sampler = DDIMSampler(SCHEDULE, 10, eta=eta)
        return sampler.sample(lambda i, x, t: eps(x, t), noise, torch.Generator().manual_seed(seed))

    assert torch.equal(run(0.0, 1), run(0.0, 2))
    assert not torch.allclose(run(1.0, 1), run(1.0, 2))


def test_timestep_spacings() -> None:
    """trailing starts at T-1, leading is k*(T//N), linspace rounds; all strictly descending."""
    assert SCHEDULE.timesteps(4, "trailing") == [999, 749, 499, 249]
    assert SCHEDULE.timesteps(4, "leading") == [750, 500, 250, 0]
    assert SCHEDULE.timesteps(4, "linspace") == [999, 666, 333, 0]
    assert SCHEDULE.timesteps(1, "linspace") == [0]
    assert NoiseSchedule(beta_schedule="cosine").alphas_cumprod[-1] < 1e-4
    sl = NoiseSchedule(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012)
    assert 0.004 < float(sl.alphas_cumprod[-1]) < 0.006  # Stable Diffusion's final alpha-bar


def test_errors_name_the_bad_argument() -> None:
    """Bad steps, spacing, timesteps, eta and a denoiser of the wrong shape are rejected clearly."""
    with pytest.raises(ValueError, match=r"num_steps must be in \[1, 1000\].*got 0"):
        SCHEDULE.timesteps(0)
    with pytest.raises(ValueError, match="spacing must be"):
        SCHEDULE.timesteps(4, "random")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="strictly descending"):
        DDIMSampler(SCHEDULE, timesteps=[10, 500, 999])
    with pytest.raises(ValueError, match="eta must be >= 0"):
        DDIMSampler(SCHEDULE, eta=-1.0)
    with pytest.raises(ValueError, match="unknown sampler 'euler'"):
        make_sampler("euler", SCHEDULE)
    with pytest.raises(ValueError, match="beta_start"):
        NoiseSchedule(beta_start=0.1, beta_end=0.01)
    x = torch.zeros(2, 3)
    with pytest.raises(
        ValueError, match=r"returned shape \(2, 1\) at step 0, but x has shape \(2, 3\)"
    ):
        DDIMSampler(SCHEDULE, 3).sample(lambda i, x, t: x[:, :1], x)


# ---------------------------------------------------------------------------- diffusers parity


def _run_diffusers(scheduler, eps, x, generator=None):
    for t in scheduler.timesteps:
        x = scheduler.step(eps(x, t.repeat(len(x))), t, x, generator=generator).prev_sample
    return x


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("steps", [10, 50])
def test_parity_with_diffusers_schedulers(steps: int) -> None:
    """DDIM, DDPM and DPM-Solver++(2M) match diffusers' schedulers step for step (fp32 tolerance)."""
    diffusers = pytest.importorskip("diffusers")
    eps = gaussian_eps(SCHEDULE)
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))

    ddim = diffusers.DDIMScheduler(clip_sample=False, timestep_spacing="leading")
    ddim.set_timesteps(steps)
    ours = DDIMSampler(SCHEDULE, timesteps=ddim.timesteps.tolist())
    ref = _run_diffusers(ddim, eps, x)
    torch.testing.assert_close(ours.sample(lambda i, x, t: eps(x, t), x), ref, rtol=1e-4, atol=1e-5)

    clipped = diffusers.DDIMScheduler(clip_sample=True, timestep_spacing="leading")
    clipped.set_timesteps(steps)
    wide = gaussian_eps(SCHEDULE, std=1.5)  # wide data, so that clipping x0 to [-1, 1] matters
    ref = x
    for t in clipped.timesteps:
        out = clipped.step(wide(ref, t.repeat(len(x))), t, ref, use_clipped_model_output=True)
        ref = out.prev_sample
    ours = DDIMSampler(SCHEDULE, timesteps=clipped.timesteps.tolist(), clip_denoised=1.0)
    torch.testing.assert_close(
        ours.sample(lambda i, x, t: wide(x, t), x), ref, rtol=1e-4, atol=1e-5
    )
    assert ref.abs().max() <= 1.0 + 1e-6

    ddpm = diffusers.DDPMScheduler()
    ddpm.set_timesteps(steps)
    ref = _run_diffusers(ddpm, eps, x, torch.Generator().manual_seed(3))
    out = DDPMSampler(SCHEDULE, timesteps=ddpm.timesteps.tolist()).sample(
        lambda i, x, t: eps(x, t), x, torch.Generator().manual_seed(3)
    )
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)

    dpm = diffusers.DPMSolverMultistepScheduler(
        algorithm_type="dpmsolver++", solver_order=2, final_sigmas_type="zero"
    )
    dpm.set_timesteps(steps)
    ref = _run_diffusers(dpm, eps, x)
    out = DPMSolverPP2MSampler(SCHEDULE, timesteps=dpm.timesteps.tolist()).sample(
        lambda i, x, t: eps(x, t), x
    )
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
