"""Diffusion inference with classifier-free guidance and selective guidance.

* Samplers over any noise-prediction callable: :class:`DDPMSampler`, :class:`DDIMSampler`,
  :class:`DPMSolverPP2MSampler` (:func:`make_sampler` by name) on a :class:`NoiseSchedule`.
* Guidance schedules deciding each step's scale, and so which branches run:
  :class:`ConstantGuidance` (plain CFG), :class:`SelectiveGuidance` (skip the unconditional branch
  in the last -- or first -- fraction of the steps; arXiv 2305.09847) and :class:`CustomGuidance`.
  :func:`guided_sample` batches the two branches into one forward and reports what ran.
* A real trained model offline: :func:`load_or_train_digits` (class-conditional UNet and a judge
  classifier on scikit-learn's digits, trained with slipstream's engine, cached on disk) and the
  metrics to judge samples (:func:`class_accuracy`, :func:`frechet_distance`).

Example::

    from slipstream.diffusion import DDIMSampler, SelectiveGuidance, guided_sample
    out = guided_sample(unet, DDIMSampler(schedule, 50), noise, labels, null_label,
                        SelectiveGuidance(scale_value=3.0, fraction=0.2))
    out.samples, out.stats.rows
"""

from slipstream.diffusion.adapters import DiffusersUNetDenoiser
from slipstream.diffusion.digits import DigitClassifier, DigitsData, load_digits_data
from slipstream.diffusion.guidance import (
    ConstantGuidance,
    CustomGuidance,
    Denoiser,
    GuidanceSchedule,
    GuidanceStats,
    GuidedDenoiser,
    SelectiveGuidance,
)
from slipstream.diffusion.metrics import (
    class_accuracy,
    frechet_distance,
    image_grid,
    mean_pairwise_distance,
    sample_features,
    save_image_grid,
)
from slipstream.diffusion.noise import NoiseSchedule
from slipstream.diffusion.pretrained import (
    DigitsModels,
    DigitsRecipe,
    default_cache_dir,
    load_or_train_digits,
)
from slipstream.diffusion.samplers import (
    DDIMSampler,
    DDPMSampler,
    DPMSolverPP2MSampler,
    Sampler,
    SampleResult,
    guided_sample,
    make_sampler,
)
from slipstream.diffusion.training import (
    ClassifierTrainConfig,
    DiffusionTrainConfig,
    train_classifier,
    train_diffusion,
)

__all__ = [
    "ClassifierTrainConfig",
    "ConstantGuidance",
    "CustomGuidance",
    "DDIMSampler",
    "DDPMSampler",
    "DPMSolverPP2MSampler",
    "Denoiser",
    "DiffusersUNetDenoiser",
    "DiffusionTrainConfig",
    "DigitClassifier",
    "DigitsData",
    "DigitsModels",
    "DigitsRecipe",
    "GuidanceSchedule",
    "GuidanceStats",
    "GuidedDenoiser",
    "NoiseSchedule",
    "SampleResult",
    "Sampler",
    "SelectiveGuidance",
    "class_accuracy",
    "default_cache_dir",
    "frechet_distance",
    "guided_sample",
    "image_grid",
    "load_digits_data",
    "load_or_train_digits",
    "make_sampler",
    "mean_pairwise_distance",
    "sample_features",
    "save_image_grid",
    "train_classifier",
    "train_diffusion",
]
