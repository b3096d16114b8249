"""The Adaptive Patch Framework (APF) front end: images (+ masks) -> adaptive token batches.

Zhang et al., "Adaptive Patching for High-resolution Image Segmentation with Transformers",
SC24, arXiv 2404.09707, sec. III-A. Pipeline per batch, all in PyTorch on the images' device::

    grey (BT.601, 0-255) -> Gaussian blur (k x k) -> Canny -> quadtree -> L leaves
    -> every leaf resized to P x P -> tokens (B, L, C, P, P), targets (B, L, P, P)

The model sees only tokens (plus, optionally, leaf geometry), so APF is pure preprocessing:
an all-edge image with L = 4**k reproduces plain ViT patching exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Literal

import torch
from torch import Tensor

from slipstream.config._errors import ConfigError
from slipstream.vision.edges import (
    edge_points,
    edge_points_and_means,
    means_misfit,
    resolve_edge_backend,
)
from slipstream.vision.quadtree import (
    Leaves,
    _check_edges,
    _fixed_length_tree,
    _points,
    _threshold_tree,
    uniform_leaves,
)
from slipstream.vision.tokens import extract_tokens, tokens_to_image

__all__ = ["APFConfig", "AdaptivePatcher", "PatchBatch"]


# Means the CPU edge pass pools for the tokens (leaves of 8P and up read them).
_FUSED_FACTOR = 8


def _pow2(v: int) -> bool:
    return v >= 1 and not v & (v - 1)


@dataclass(frozen=True)
class APFConfig:
    """Hyper-parameters of the adaptive patcher. Defaults follow the authors' PAIP release."""

    patch_size: int = 8
    """P: every token is P x P pixels (power of two)."""
    variant: Literal["fixed_length", "threshold"] = "fixed_length"
    """"fixed_length": split the most-edged leaf until ``length`` leaves (later release);
    "threshold": split while a node holds more than ``threshold`` edge pixels (first release)."""
    length: int | None = 385
    """L, tokens per image. Required for "fixed_length" (1 mod 3); for "threshold" rows are
    padded to it (leaves dropped at random when over), or to the batch's longest row if None."""
    min_size: int = 2
    """Smallest leaf side (power of two)."""
    max_size: int | None = None
    """Largest leaf side (power of two); larger nodes are always split. None: the image."""
    threshold: int = 50
    """"threshold" variant: split iff a node holds more edge pixels than this."""
    max_depth: int = 10
    """"threshold" variant: deepest level that may still split."""
    blur_kernel: int = 3
    """Odd Gaussian kernel side before Canny (sigma by OpenCV's rule); 1 disables blurring."""
    canny_low: float = 100.0
    """Canny low hysteresis threshold (0-255 gradient units, or a fraction if relative)."""
    canny_high: float = 200.0
    """Canny high hysteresis threshold."""
    canny_norm: Literal["l1", "l2"] = "l1"
    """Gradient magnitude for the thresholds: "l1" = |gi| + |gj| (OpenCV's default, which
    the authors' thresholds assume), "l2" = Euclidean (scikit-image)."""
    canny_relative: bool = False
    """Read the Canny thresholds as fractions of each image's peak gradient (scale-free: use
    for images upsampled far beyond their detail, or low-contrast microscopy)."""
    image_resize: Literal["area", "nearest"] = "area"
    """How leaves become P x P image tokens (area = box filter; nearest = authors' apt)."""
    mask_resize: Literal["area", "nearest"] = "area"
    """How leaves become P x P mask targets (area gives soft targets in [0, 1])."""
    backend: Literal["auto", "torch", "numba"] = "auto"
    """CPU kernels: "numba" runs the edge pipeline as one fused loop per row and pools
    bool masks / uint8 images in integers, "torch" uses eager tensor ops (any device), "auto"
    numba for CPU inputs when it is installed. Same edges, trees and tokens either way (bit
    for bit; float pooling is torch's ``avg_pool2d`` in both)."""

    def __post_init__(self) -> None:
        for name in ("patch_size", "min_size"):
            if not _pow2(getattr(self, name)):
                raise ConfigError(
                    f"APFConfig.{name}={getattr(self, name)} must be a power of two (1, 2, 4, 8, ...)"
                )
        if self.max_size is not None and (
            not _pow2(self.max_size) or self.max_size < self.min_size
        ):
            raise ConfigError(
                f"APFConfig.max_size={self.max_size} must be a power of two >= "
                f"min_size={self.min_size}, or None"
            )
        if self.variant not in ("fixed_length", "threshold"):
            raise ConfigError(
                f"APFConfig.variant={self.variant!r} is unknown; use 'fixed_length' or 'threshold'"
            )
        if self.variant == "fixed_length":
            if self.length is None or self.length < 1 or self.length % 3 != 1:
                raise ConfigError(
                    f"APFConfig.length={self.length} must be 1 mod 3 for the fixed_length "
                    "variant (each split adds 3 leaves); e.g. 64, 196, 256, 385, 1024"
                )
        elif self.length is not None and self.length < 1:
            raise ConfigError(f"APFConfig.length={self.length} must be >= 1 or None")
        if self.blur_kernel < 1 or self.blur_kernel % 2 == 0:
            raise ConfigError(
                f"APFConfig.blur_kernel={self.blur_kernel} must be odd and >= 1 (1 = no blur)"
            )
        if self.canny_low > self.canny_high:
            raise ConfigError(
                f"APFConfig.canny_low={self.canny_low} exceeds canny_high={self.canny_high}; "
                "swap them"
            )
        if self.canny_norm not in ("l1", "l2"):
            raise ConfigError(
                f"APFConfig.canny_norm={self.canny_norm!r} is unknown; use 'l1' or 'l2'"
            )
        if self.backend not in ("auto", "torch", "numba"):
            raise ConfigError(
                f"APFConfig.backend={self.backend!r} is unknown; use 'auto', 'torch' or 'numba'"
            )
        for name in ("image_resize", "mask_resize"):
            if getattr(self, name) not in ("area", "nearest"):
                raise ConfigError(
                    f"APFConfig.{name}={getattr(self, name)!r} is unknown; use 'area' or 'nearest'"
                )


@dataclass
class PatchBatch:
    """Tokens of a batch plus the tree that made them; the model's input and target."""

    tokens: Tensor
    """(B, L, C, P, P) image tokens (zeros at padding)."""
    leaves: Leaves
    """Leaf geometry in token order."""
    targets: Tensor | None = None
    """(B, L, P, P) mask tokens in [0, 1], if masks were given."""

    @property
    def valid(self) -> Tensor:
        """(B, L) bool, False at padding tokens."""
        return self.leaves.valid

    @property
    def geometry(self) -> Tensor:
        """(B, L, 3) float: leaf centre row, column (fractions of R; -1 at padding), depth."""
        return torch.cat(
            [self.leaves.centres(), self.leaves.depth().unsqueeze(-1).float()], dim=-1
        ).to(self.tokens.dtype)

    def to_image(self, values: Tensor, fill: float = 0.0) -> Tensor:
        """Per-token maps (B, L, P, P) -> full-resolution (B, R, R); see ``tokens_to_image``."""
        return tokens_to_image(values, self.leaves, fill)


class AdaptivePatcher:
    """Turn (B, C, R, R) images (and (B, R, R) masks) into adaptive token batches.

    Images are float in [0, 1] or uint8 in 0-255 (decoded files: a quarter of the bytes, and
    the faster input at high resolution); tokens are float in [0, 1] either way (float32 for
    uint8 input).

    Example::

        patcher = AdaptivePatcher(APFConfig(patch_size=8, length=1024))
        batch = patcher(images, masks)          # batch.tokens: (B, 1024, C, 8, 8)
        logits = model(batch.tokens, batch.valid)
        mask = batch.to_image(logits.sigmoid()) > 0.5   # (B, R, R)
    """

    def __init__(self, config: APFConfig | None = None, **overrides: object) -> None:
        cfg = config or APFConfig()
        unknown = sorted(set(overrides) - {f.name for f in fields(APFConfig)})
        if unknown:
            raise ConfigError(f"unknown APFConfig field(s) {unknown}; see APFConfig")
        self.config = replace(cfg, **overrides) if overrides else cfg  # type: ignore[arg-type]

    def _check(self, images: Tensor, masks: Tensor | None) -> None:
        if not (images.is_floating_point() or images.dtype == torch.uint8):
            raise ValueError(
                f"images must be float in [0, 1] or uint8 in 0-255, got {images.dtype}; "
                "convert with images.float() / max_value"
            )
        if images.dim() != 4 or images.shape[-1] != images.shape[-2]:
            raise ValueError(
                f"images must have shape (batch, channels, R, R), got {tuple(images.shape)}; "
                "make them square with slipstream.vision.resize_square"
            )
        r = images.shape[-1]
        if not _pow2(r) or r < self.config.patch_size:
            raise ValueError(
                f"image side R={r} must be a power of two >= patch_size="
                f"{self.config.patch_size}; resize with slipstream.vision.resize_square"
            )
        if masks is not None and masks.shape != (images.shape[0], r, r):
            raise ValueError(
                f"masks must have shape (batch, R, R) = {(images.shape[0], r, r)}, "
                f"got {tuple(masks.shape)}"
            )

    def edge_points(self, images: Tensor) -> Tensor:
        """Sorted flat indices into (B, R, R) of the edge pixels (APF steps 1-2, sparse).

        What :meth:`__call__` uses: the edge map is computed strip by strip and never built
        densely (see :func:`slipstream.vision.edges.edge_points`).
        """
        c = self.config
        return edge_points(
            images,
            blur_kernel=c.blur_kernel,
            low=c.canny_low,
            high=c.canny_high,
            relative=c.canny_relative,
            norm=c.canny_norm,
            backend=c.backend,
        )

    def edges(self, images: Tensor) -> Tensor:
        """(B, R, R) bool Canny edge map of the blurred 8-bit grey images (APF steps 1-2)."""
        b, _, h, w = images.shape
        out = torch.zeros(b * h * w, dtype=torch.bool, device=images.device)
        out[self.edge_points(images)] = True
        return out.view(b, h, w)

    def tree(self, edges: Tensor, generator: torch.Generator | None = None) -> Leaves:
        """Quadtree leaves of (B, R, R) edge maps (APF step 3), padded to ``length``."""
        r = _check_edges(edges)
        return self.tree_of_points(_points(edges), edges.shape[0], r, generator)

    def tree_of_points(
        self, points: Tensor, batch: int, r: int, generator: torch.Generator | None = None
    ) -> Leaves:
        """:meth:`tree` of the edge pixels ``points`` (flat indices into (B, R, R))."""
        c = self.config
        if c.variant == "fixed_length":
            assert c.length is not None
            return _fixed_length_tree(points, batch, r, c.length, c.min_size, c.max_size)
        return _threshold_tree(
            points, batch, r, c.threshold, c.max_depth, c.min_size, c.max_size, c.length,
            generator,
        )  # fmt: skip

    def tokens(
        self,
        images: Tensor,
        leaves: Leaves,
        masks: Tensor | None = None,
        means: tuple[int, Tensor] | None = None,
    ) -> PatchBatch:
        """Tokens (and mask targets) of ``images`` for given leaves (APF step 4); ``means``
        are box means from the edge pass (see :func:`extract_tokens`)."""
        c = self.config
        tokens = extract_tokens(images, leaves, c.patch_size, c.image_resize, c.backend, means)
        if images.dtype == torch.uint8:
            tokens.div_(255.0)
        targets = None
        if masks is not None:
            m = masks.unsqueeze(1)  # bool is pooled in integers, never copied to float whole
            targets = extract_tokens(m, leaves, c.patch_size, c.mask_resize, c.backend)[:, :, 0]
            targets = targets.to(tokens.dtype)
        return PatchBatch(tokens=tokens, leaves=leaves, targets=targets)

    def __call__(
        self,
        images: Tensor,
        masks: Tensor | None = None,
        *,
        edges: Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> PatchBatch:
        """Adaptive tokens of ``images``; ``edges`` overrides the Canny map (e.g. precomputed).

        Raises:
            ValueError: images not (B, C, R, R) with R a power of two >= P, or mask shape.
        """
        self._check(images, masks)
        if edges is not None:
            return self.tokens(images, self.tree(edges, generator), masks)
        points, means = self.edge_points_and_means(images)
        leaves = self.tree_of_points(points, images.shape[0], images.shape[-1], generator)
        return self.tokens(images, leaves, masks, means)

    def edge_points_and_means(self, images: Tensor) -> tuple[Tensor, tuple[int, Tensor] | None]:
        """What :meth:`__call__` runs first: the edge pixels (as :meth:`edge_points`), and
        (f, f x f means of ``images``) when the CPU edge pass pools the tokens' first level
        while it reads the image (numba backend, float32/uint8 images), else None."""
        factor = self._fused_factor(images)
        if not factor:
            return self.edge_points(images), None
        c = self.config
        points, means = edge_points_and_means(
            images, factor, blur_kernel=c.blur_kernel, low=c.canny_low, high=c.canny_high,
            relative=c.canny_relative, norm=c.canny_norm,
        )  # fmt: skip
        return points, (factor, means)

    def _fused_factor(self, images: Tensor) -> int:
        """f of the means the edge pass should pool (0: a separate pass, as on GPU).

        CPU float32/uint8 images with area tokens under the numba backend. f = 8: the pooled
        level serves leaves of side 8P and up, most leaves of APF trees at high resolution;
        smaller leaves are box-filtered from their own pixels, so every tree is served.
        """
        c = self.config
        f = _FUSED_FACTOR
        fits = (
            c.image_resize == "area"
            and images.shape[-1] >= 2 * f * c.patch_size
            and means_misfit(images, f, c.blur_kernel) is None
        )
        return f if fits and resolve_edge_backend(c.backend, images) == "numba" else 0

    def uniform(
        self, images: Tensor, masks: Tensor | None = None, length: int | None = None
    ) -> PatchBatch:
        """Baseline: a uniform grid of ``length`` (a power of 4; default the config's length
        rounded down to one) leaves, each resized to P x P like the adaptive ones."""
        self._check(images, masks)
        r = images.shape[-1]
        n_tokens = length or self.config.length or (r // self.config.patch_size) ** 2
        k = (n_tokens.bit_length() - 1) // 2
        if length is not None and 4**k != length:
            raise ValueError(f"length={length} must be a power of 4 for a uniform grid (4**k)")
        side = max(r >> k, 1)
        leaves = uniform_leaves(images.shape[0], r, side, images.device)
        return self.tokens(images, leaves, masks)
