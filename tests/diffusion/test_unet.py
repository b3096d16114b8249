"""The small class-conditional UNet (slipstream/models/unet.py)."""

from __future__ import annotations

import pytest
import torch

from slipstream.models.unet import UNet, UNetConfig
from tests.diffusion._toys import tiny_unet


def test_unet_predicts_noise_shape_and_depends_on_label_and_time() -> None:
    """Output has the input's shape; changing the label or the timestep changes it; None = null label."""
    unet = tiny_unet()
    x = torch.randn(3, 1, 8, 8)
    t = torch.tensor([10, 500, 900])
    with torch.no_grad():
        out = unet(x, t, torch.tensor([1, 2, 3]))
        assert out.shape == x.shape
        assert not torch.allclose(out, unet(x, t, torch.tensor([4, 2, 3])))
        assert not torch.allclose(out, unet(x, t + 50, torch.tensor([1, 2, 3])))
        assert torch.equal(unet(x, t), unet(x, t, torch.full((3,), unet.null_label)))
        assert torch.equal(unet(x, torch.tensor(7), None), unet(x, torch.full((3,), 7), None))


def test_unet_trains_by_gradient() -> None:
    """A few Adam steps on one batch lower the ε-prediction loss (every parameter gets a gradient)."""
    torch.manual_seed(0)
    unet = UNet(UNetConfig(image_size=8, base_channels=8, channel_mults=(1, 2), attention=True))
    x, t, y = torch.randn(8, 1, 8, 8), torch.randint(0, 1000, (8,)), torch.randint(0, 11, (8,))
    target = torch.randn_like(x)
    opt = torch.optim.Adam(unet.parameters(), 3e-3)
    losses = []
    for _ in range(15):
        loss = (unet(x, t, y) - target).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        losses.append(loss.item())
        opt.step()
    assert all(p.grad is not None for p in unet.parameters())
    assert losses[-1] < 0.8 * losses[0]


def test_unet_errors_name_the_bad_value() -> None:
    """Bad configs, input shapes and labels raise errors naming the field and value."""
    with pytest.raises(ValueError, match="image_size=10 is not divisible by 4"):
        UNetConfig(image_size=10, channel_mults=(1, 2, 2))
    with pytest.raises(ValueError, match="divisible by groups=8"):
        UNetConfig(base_channels=12)
    unet = tiny_unet()
    with pytest.raises(ValueError, match=r"\(B, 1, H, W\) .* got shape \(2, 3, 8, 8\)"):
        unet(torch.zeros(2, 3, 8, 8), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 10\].*max 11"):
        unet(torch.zeros(2, 1, 8, 8), torch.zeros(2, dtype=torch.long), torch.tensor([0, 11]))
