"""Adaptive patching (APF) for high-resolution segmentation with transformers.

Zhang et al., "Adaptive Patching for High-resolution Image Segmentation with Transformers",
SC24, arXiv 2404.09707. An edge map drives a quadtree; every leaf becomes one P x P token, so
a high-resolution image is segmented from a short token sequence by an unmodified ViT
(:class:`slipstream.models.vit.ViTSegmenter`). See ``docs/apf.md``.

Public API::

    AdaptivePatcher, APFConfig, PatchBatch       # images (+ masks) -> tokens, and back
    canny, gaussian_blur, to_grey                 # edge detection (PyTorch, batched)
    threshold_quadtree, fixed_length_quadtree     # the two quadtree variants
    Leaves, uniform_leaves, summed_area_table, box_counts, morton_encode
    extract_tokens, tokens_to_image, patchify     # leaves <-> tokens
    bce_dice_loss, soft_dice_loss, dice_score     # loss and metric
    synthetic_blobs, bundled_image, horse_mask, ihc_dab_mask, resize_square, tile  # data
    tokenize, train_segmenter, evaluate_dice, oracle_dice  # adaptive vs uniform runs
"""

from slipstream.vision.canny import canny, gaussian_blur, gaussian_kernel_sigma, to_grey
from slipstream.vision.data import (
    bundled_image,
    horse_mask,
    ihc_dab_mask,
    otsu_threshold,
    resize_square,
    rgb_to_hed,
    synthetic_blobs,
    tile,
)
from slipstream.vision.losses import bce_dice_loss, dice_score, soft_dice_loss
from slipstream.vision.patcher import AdaptivePatcher, APFConfig, PatchBatch
from slipstream.vision.quadtree import (
    Leaves,
    box_counts,
    fixed_length_quadtree,
    morton_encode,
    summed_area_table,
    threshold_quadtree,
    uniform_leaves,
)
from slipstream.vision.tokens import extract_tokens, patchify, tokens_to_image
from slipstream.vision.training import (
    TokenSet,
    TrainResult,
    evaluate_dice,
    oracle_dice,
    tokenize,
    train_segmenter,
)

__all__ = [
    "APFConfig",
    "AdaptivePatcher",
    "Leaves",
    "PatchBatch",
    "TokenSet",
    "TrainResult",
    "bce_dice_loss",
    "box_counts",
    "bundled_image",
    "canny",
    "dice_score",
    "evaluate_dice",
    "extract_tokens",
    "fixed_length_quadtree",
    "gaussian_blur",
    "gaussian_kernel_sigma",
    "horse_mask",
    "ihc_dab_mask",
    "morton_encode",
    "oracle_dice",
    "otsu_threshold",
    "patchify",
    "resize_square",
    "rgb_to_hed",
    "soft_dice_loss",
    "summed_area_table",
    "synthetic_blobs",
    "threshold_quadtree",
    "tile",
    "to_grey",
    "tokenize",
    "tokens_to_image",
    "train_segmenter",
    "uniform_leaves",
]
