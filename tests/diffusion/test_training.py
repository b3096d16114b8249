"""Training through slipstream's engine and the on-disk cache of the digits models (tiny sizes)."""

from __future__ import annotations

import pytest
import torch

from slipstream.diffusion import (
    ClassifierTrainConfig,
    DiffusionTrainConfig,
    DigitsRecipe,
    load_digits_data,
    load_or_train_digits,
)
from slipstream.models.unet import UNetConfig

pytest.importorskip("sklearn")


def _recipe(steps: int = 40, log_every: int = 0) -> DigitsRecipe:
    return DigitsRecipe(
        image_size=8,
        unet=UNetConfig(image_size=8, base_channels=8, channel_mults=(1, 2), attention=False),
        diffusion=DiffusionTrainConfig(
            steps=steps, batch_size=32, lr=3e-3, warmup_steps=5, log_every=log_every
        ),
        classifier=ClassifierTrainConfig(steps=60, batch_size=64, lr=3e-3),
    )


def test_digits_data_is_upsampled_scaled_and_split_per_class() -> None:
    """1797 digits in [-1, 1] at the asked size, 20% of every class held out."""
    data = load_digits_data(16)
    assert data.train_images.shape[1:] == (1, 16, 16)
    assert len(data.train_images) + len(data.test_images) == 1797
    assert data.train_images.min() >= -1 and data.train_images.max() <= 1
    counts = torch.bincount(data.test_labels, minlength=10)
    assert counts.min() >= 34 and counts.max() <= 37


def test_load_or_train_trains_once_caches_and_reloads(tmp_path) -> None:
    """First call trains with the engine (loss falls) and writes a checkpoint; the second only loads it."""
    losses: list[float] = []
    first = load_or_train_digits(_recipe(), tmp_path, progress=lambda s, loss: losses.append(loss))
    assert first.trained_now and first.path.exists() and first.path.is_relative_to(tmp_path)
    assert first.classifier_test_accuracy > 0.7
    second = load_or_train_digits(_recipe(), tmp_path)
    assert not second.trained_now and second.path == first.path
    for a, b in zip(first.unet.state_dict().values(), second.unet.state_dict().values()):
        assert torch.equal(a, b)
    other = _recipe(steps=41)
    assert other.key() != _recipe().key()


def test_diffusion_loss_decreases_and_corrupt_checkpoint_is_regenerated(tmp_path) -> None:
    """The ε-loss falls during training; a truncated cache file is replaced by a fresh training."""
    recipe = _recipe(steps=60, log_every=10)
    path = tmp_path / "diffusion" / f"digits-{recipe.key()}.pt"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a checkpoint")
    losses: list[float] = []
    models = load_or_train_digits(recipe, tmp_path, progress=lambda s, loss: losses.append(loss))
    assert models.trained_now and path.stat().st_size > 10_000
    assert len(losses) == 6 and losses[-1] < 0.7 * losses[0]


def test_train_config_errors() -> None:
    """Bad hyper-parameters are rejected with the values in the message."""
    with pytest.raises(ValueError, match="label_dropout"):
        DiffusionTrainConfig(label_dropout=1.5)
    with pytest.raises(ValueError, match="num_classes=10"):
        DigitsRecipe(unet=UNetConfig(image_size=16, num_classes=5))
