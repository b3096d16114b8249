"""The trained digits models, cached on disk and regenerated when missing.

:func:`load_or_train_digits` returns a class-conditional UNet trained on scikit-learn's digits
(:mod:`slipstream.diffusion.digits`) plus the classifier that judges its samples. Both are
trained with slipstream's engine in a few CPU minutes and cached under
``$SLIPSTREAM_CACHE`` (default ``~/.cache/slipstream``) as ``diffusion/digits-<hash>.pt``, where the
hash covers the whole :class:`DigitsRecipe`: changing any hyper-parameter trains anew, and a
checkpoint is written atomically (temporary file + rename) and checked against its recipe on load.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from slipstream.diffusion.digits import DigitClassifier, DigitsData, load_digits_data
from slipstream.diffusion.metrics import class_accuracy
from slipstream.diffusion.noise import BetaSchedule, NoiseSchedule
from slipstream.diffusion.training import (
    ClassifierTrainConfig,
    DiffusionTrainConfig,
    Progress,
    train_classifier,
    train_diffusion,
)
from slipstream.models.unet import UNet, UNetConfig

__all__ = ["DigitsModels", "DigitsRecipe", "default_cache_dir", "load_or_train_digits"]

logger = logging.getLogger(__name__)

_FORMAT_VERSION = 1


def default_cache_dir() -> Path:
    """``$SLIPSTREAM_CACHE`` or ``~/.cache/slipstream``."""
    return Path(os.environ.get("SLIPSTREAM_CACHE", Path.home() / ".cache" / "slipstream"))


@dataclass(frozen=True)
class DigitsRecipe:
    """Everything that determines the trained digits models (hashed into the cache file name).

    Attributes:
        image_size: the digits are upsampled from 8x8 to this size.
        unet: the UNet shape (``num_classes`` 10; label 10 is the null label).
        beta_schedule: the training noise schedule. The default, ``"cosine"`` (improved DDPM,
            Nichol & Dhariwal 2021, §3.2), spreads the steps evenly in log-SNR, which low
            resolutions need; Stable Diffusion's ``"scaled_linear"`` (β 0.00085 to 0.012) spends
            the first fifth of the steps at log-SNR below -3, where a 16x16 digit is not formed
            yet (see docs/selective_guidance.md).
        beta_start: first β of the linear schedules.
        beta_end: last β of the linear schedules.
        num_train_timesteps: ``T``.
        diffusion: diffusion training hyper-parameters.
        classifier: classifier training hyper-parameters.
        data_seed: seed of the train/test split.
    """

    image_size: int = 16
    unet: UNetConfig = field(
        default_factory=lambda: UNetConfig(image_size=16, base_channels=16, channel_mults=(1, 2, 2))
    )
    beta_schedule: BetaSchedule = "cosine"
    beta_start: float = 1e-4
    beta_end: float = 0.02
    num_train_timesteps: int = 1000
    diffusion: DiffusionTrainConfig = field(
        default_factory=lambda: DiffusionTrainConfig(steps=1200, batch_size=64)
    )
    classifier: ClassifierTrainConfig = field(default_factory=ClassifierTrainConfig)
    data_seed: int = 0

    def __post_init__(self) -> None:
        if self.unet.image_size != self.image_size or self.unet.num_classes != 10:
            raise ValueError(
                f"DigitsRecipe.unet must have image_size={self.image_size} and num_classes=10, "
                f"got image_size={self.unet.image_size}, num_classes={self.unet.num_classes}"
            )

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)

    def key(self) -> str:
        """A short stable hash of the recipe."""
        blob = json.dumps({"v": _FORMAT_VERSION, **self.to_dict()}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    def noise_schedule(self) -> NoiseSchedule:
        return NoiseSchedule(
            self.num_train_timesteps, self.beta_schedule, self.beta_start, self.beta_end
        )


@dataclass
class DigitsModels:
    """The trained models and what they were trained on.

    Attributes:
        unet: the class-conditional denoiser (EMA weights, eval mode); ``unet.null_label`` is 10.
        classifier: the judge (eval mode).
        schedule: the training noise schedule (samplers must use it).
        data: the train/test split used.
        recipe: the recipe.
        path: the checkpoint file.
        classifier_test_accuracy: the classifier's accuracy on the held-out real digits.
        train_seconds: wall time of training (in the run that trained them).
        trained_now: whether this call trained them (False: loaded from the cache).
    """

    unet: UNet
    classifier: DigitClassifier
    schedule: NoiseSchedule
    data: DigitsData
    recipe: DigitsRecipe
    path: Path
    classifier_test_accuracy: float
    train_seconds: float
    trained_now: bool


def _checkpoint_path(recipe: DigitsRecipe, cache_dir: str | Path | None) -> Path:
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return root / "diffusion" / f"digits-{recipe.key()}.pt"


def _load(path: Path, recipe: DigitsRecipe) -> dict[str, object] | None:
    if not path.exists():
        return None
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a truncated or foreign file: retrain rather than fail
        logger.warning("ignoring unreadable checkpoint %s (%s); training anew", path, err)
        return None
    if blob.get("recipe") != json.loads(json.dumps(recipe.to_dict())):
        logger.warning("checkpoint %s was made from another recipe; training anew", path)
        return None
    return blob


def _train(recipe: DigitsRecipe, data: DigitsData, progress: Progress | None) -> dict[str, object]:
    start = time.perf_counter()
    torch.manual_seed(recipe.diffusion.seed)
    clf = train_classifier(
        DigitClassifier(), data.train_images, data.train_labels, recipe.classifier
    ).model
    unet = UNet(recipe.unet)
    result = train_diffusion(
        unet,
        data.train_images,
        data.train_labels,
        unet.null_label,
        recipe.noise_schedule(),
        recipe.diffusion,
        progress,
    )
    # Clone: trained parameters may be views into the engine's flat buffers.
    return {
        "recipe": json.loads(json.dumps(recipe.to_dict())),
        "unet": {k: v.detach().clone().cpu() for k, v in result.model.state_dict().items()},
        "classifier": {k: v.detach().clone().cpu() for k, v in clf.state_dict().items()},
        "train_seconds": time.perf_counter() - start,
    }


def load_or_train_digits(
    recipe: DigitsRecipe | None = None,
    cache_dir: str | Path | None = None,
    *,
    retrain: bool = False,
    progress: Progress | None = None,
) -> DigitsModels:
    """Load the digits diffusion model and classifier from the cache, training them if missing.

    Args:
        recipe: what to train (default :class:`DigitsRecipe`: about 0.3M-parameter UNet,
            2,000 steps, a few CPU minutes).
        cache_dir: cache root (default :func:`default_cache_dir`); checkpoints never go in git.
        retrain: train even if a checkpoint exists (and overwrite it).
        progress: ``progress(step, loss)`` during diffusion training (see ``log_every``).
    Returns:
        :class:`DigitsModels`.
    """
    recipe = recipe or DigitsRecipe()
    data = load_digits_data(recipe.image_size, seed=recipe.data_seed)
    path = _checkpoint_path(recipe, cache_dir)
    blob = None if retrain else _load(path, recipe)
    trained_now = blob is None
    if blob is None:
        blob = _train(recipe, data, progress)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        torch.save(blob, tmp)
        os.replace(tmp, path)
        logger.info("trained digits models in %.0f s; saved %s", blob["train_seconds"], path)
    unet = UNet(recipe.unet)
    unet.load_state_dict(blob["unet"])  # type: ignore[arg-type]
    clf = DigitClassifier()
    clf.load_state_dict(blob["classifier"])  # type: ignore[arg-type]
    unet.eval().requires_grad_(False)
    clf.eval().requires_grad_(False)
    return DigitsModels(
        unet=unet,
        classifier=clf,
        schedule=recipe.noise_schedule(),
        data=data,
        recipe=recipe,
        path=path,
        classifier_test_accuracy=class_accuracy(clf, data.test_images, data.test_labels),
        train_seconds=float(blob["train_seconds"]),  # type: ignore[arg-type]
        trained_now=trained_now,
    )
