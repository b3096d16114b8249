"""Adapters that give third-party denoisers the ``denoiser(x_t, t, cond) -> ε`` signature.

The samplers take any callable; these wrap the common cases so that nothing in the sampling code
depends on a particular model library.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["DiffusersUNetDenoiser"]


class DiffusersUNetDenoiser:
    """Wrap a diffusers ``UNet2DConditionModel`` (or ``UNet2DModel`` with class labels).

    ``cond`` is passed as ``encoder_hidden_states`` (prompt embeddings ``(B, L, D)``, with an
    empty-prompt embedding as ``uncond``), or as ``class_labels`` when ``cond_kwarg`` says so.
    Works on a model built from a config with random weights (no download needed).

    Args:
        unet: the diffusers model; its ``forward(sample, timestep, ...)`` returns ``.sample``.
        cond_kwarg: the keyword that receives ``cond``: ``"encoder_hidden_states"`` (default)
            or ``"class_labels"``.
    """

    def __init__(self, unet: Any, cond_kwarg: str = "encoder_hidden_states") -> None:
        if cond_kwarg not in ("encoder_hidden_states", "class_labels"):
            raise ValueError(
                f"cond_kwarg must be 'encoder_hidden_states' or 'class_labels', got {cond_kwarg!r}"
            )
        self.unet = unet
        self.cond_kwarg = cond_kwarg

    def __call__(self, x: torch.Tensor, t: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """``ε`` predicted by the wrapped UNet for ``x`` at timesteps ``t`` under ``cond``."""
        out = self.unet(x, t, return_dict=False, **{self.cond_kwarg: cond})
        return out[0]
