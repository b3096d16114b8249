"""Selective guidance drives a diffusers UNet2DConditionModel built from a config (no download)."""

from __future__ import annotations

import pytest
import torch

from slipstream.diffusion import (
    ConstantGuidance,
    DDIMSampler,
    DiffusersUNetDenoiser,
    NoiseSchedule,
    SelectiveGuidance,
    guided_sample,
)


def _tiny_sd_unet():
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    return diffusers.UNet2DConditionModel(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        block_out_channels=(8, 16),
        layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=12,
        attention_head_dim=4,
        norm_num_groups=4,
    ).eval()


def test_diffusers_unet_runs_one_batched_forward_per_guided_step_and_one_branch_when_skipped() -> (
    None
):
    """Text-conditioned UNet: 2B-row forwards while guided, B rows in the skipped last 50%, with prompts."""
    unet = _tiny_sd_unet()
    calls: list[tuple[int, torch.Tensor]] = []
    unet.register_forward_hook(
        lambda m, args, kwargs, out: calls.append(
            (args[0].shape[0], kwargs["encoder_hidden_states"])
        ),
        with_kwargs=True,
    )
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randn(2, 5, 12, generator=gen)  # stand-in text embeddings
    empty = torch.zeros(1, 5, 12)  # the empty-prompt embedding
    latents = torch.randn(2, 4, 8, 8, generator=gen)
    out = guided_sample(
        DiffusersUNetDenoiser(unet),
        DDIMSampler(NoiseSchedule(), 4),
        latents,
        prompts,
        empty,
        SelectiveGuidance(7.5, 0.5),
    )
    assert out.samples.shape == latents.shape and torch.isfinite(out.samples).all()
    assert [b for b, _ in calls] == [4, 4, 2, 2]
    assert torch.equal(calls[0][1][:2], empty.expand(2, 5, 12))
    assert torch.equal(calls[0][1][2:], prompts) and torch.equal(calls[-1][1], prompts)
    full = guided_sample(
        DiffusersUNetDenoiser(unet),
        DDIMSampler(NoiseSchedule(), 4),
        latents,
        prompts,
        empty,
        ConstantGuidance(7.5),
    )
    assert full.stats.rows == 16 and out.stats.rows == 12
    assert not torch.equal(full.samples, out.samples)


def test_adapter_rejects_unknown_keyword() -> None:
    """Only encoder_hidden_states and class_labels can carry the conditioning."""
    with pytest.raises(ValueError, match="cond_kwarg must be"):
        DiffusersUNetDenoiser(object(), cond_kwarg="prompt")
