"""The ViT segmenter (slipstream.models.vit): strip-conv parity, padding, positions, errors."""

from __future__ import annotations

import pytest
import torch

from slipstream.config._errors import ConfigError
from slipstream.models.vit import ViTSegConfig, ViTSegmenter


def _model(**kw: object) -> ViTSegmenter:
    torch.manual_seed(0)
    return ViTSegmenter(ViTSegConfig.preset("tiny", patch_size=4, max_tokens=32, **kw))


def test_linear_patch_embedding_is_the_stock_strip_convolution() -> None:
    """Linear over flattened tokens == Conv2d(kernel = stride = P) over the P x (L*P) token strip."""
    model = _model()
    tokens = torch.rand(2, 10, 3, 4, 4)
    conv = torch.nn.Conv2d(3, 64, kernel_size=4, stride=4)
    conv.weight.data = model.patch_embed.weight.data.view(64, 3, 4, 4)
    conv.bias.data = model.patch_embed.bias.data
    strip = tokens.permute(0, 2, 3, 1, 4).reshape(2, 3, 4, 10 * 4)
    ref = conv(strip).flatten(2).transpose(1, 2)
    torch.testing.assert_close(
        model.patch_embed(tokens.reshape(2, 10, -1)), ref, rtol=1e-5, atol=1e-5
    )


def test_padding_tokens_do_not_change_real_token_outputs() -> None:
    """Changing the content of padding tokens leaves the logits of valid tokens unchanged."""
    model = _model().eval()
    tokens = torch.rand(2, 12, 3, 4, 4)
    valid = torch.ones(2, 12, dtype=torch.bool)
    valid[:, 9:] = False
    noisy = tokens.clone()
    noisy[:, 9:] = torch.rand(2, 3, 3, 4, 4) * 10
    a, b = model(tokens, valid), model(noisy, valid)
    assert a.shape == (2, 12, 4, 4)
    torch.testing.assert_close(a[:, :9], b[:, :9], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(model(tokens), model(noisy))


def test_geometry_positions_make_outputs_depend_on_leaf_placement() -> None:
    """position='geometry' reads (centre, depth); 'slot' ignores geometry entirely."""
    tokens = torch.rand(1, 4, 3, 4, 4)
    g1 = torch.tensor([[[0.25, 0.25, 1], [0.25, 0.75, 1], [0.75, 0.25, 1], [0.75, 0.75, 1]]])
    g2 = g1.clone()
    g2[0, 0] = torch.tensor([0.125, 0.125, 2.0])
    geo = _model(position="geometry").eval()
    assert not torch.allclose(geo(tokens, None, g1), geo(tokens, None, g2))
    slot = _model(position="slot").eval()
    assert torch.equal(slot(tokens, None, g1), slot(tokens, None, g2))
    with pytest.raises(ValueError, match="needs geometry of shape"):
        geo(tokens)


def test_same_weights_run_any_sequence_length_up_to_max_tokens() -> None:
    """One model serves short (adaptive) and long (uniform) sequences; longer ones are refused."""
    model = _model()
    assert model(torch.rand(1, 7, 3, 4, 4)).shape == (1, 7, 4, 4)
    assert model(torch.rand(1, 32, 3, 4, 4)).shape == (1, 32, 4, 4)
    with pytest.raises(ValueError, match="L=33 > max_tokens=32"):
        model(torch.rand(1, 33, 3, 4, 4))
    with pytest.raises(ValueError, match=r"tokens must have shape \(batch, L, 3, 4, 4\)"):
        model(torch.rand(1, 8, 3, 8, 8))


def test_config_errors() -> None:
    """Invalid ViTSegConfig values raise ConfigError naming the field."""
    with pytest.raises(ConfigError, match="hidden_size=66 is not divisible by num_heads=4"):
        ViTSegConfig(hidden_size=66, num_heads=4)
    with pytest.raises(ConfigError, match="position='rope'"):
        ViTSegConfig(position="rope")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="unknown ViTSegConfig preset 'huge'"):
        ViTSegConfig.preset("huge")
    assert ViTSegConfig.preset("base").hidden_size == 768


def test_loss_gradients_reach_every_parameter() -> None:
    """BCE + soft-Dice backpropagates into embeddings, blocks and the decoder head."""
    from slipstream.vision import bce_dice_loss

    model = _model(position="slot+geometry")
    tokens, geometry = torch.rand(2, 6, 3, 4, 4), torch.rand(2, 6, 3)
    geometry[..., 2] = 1
    loss = bce_dice_loss(model(tokens, None, geometry), (torch.rand(2, 6, 4, 4) > 0.5).float())
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.any()]
    assert missing == []
