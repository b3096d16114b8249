"""FLOPs of one training step.

Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", appendix: a GPT step over ``B`` sequences costs

    F = 72 B s l h^2 (1 + s/(6h) + V/(16 l h))      without recomputation,
    F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h))      with full recomputation

(forward ``24 B s h^2 + 4 B s^2 h`` per layer plus ``2 B s h V`` for the logits; backward twice
the forward; full recompute one more forward of every layer, not of the logits). Selective
recompute (Korthikanti et al. 2022, sec. 5) redoes only ``Q K^T`` and ``softmax(.) V``.

The 72 form is the 96 form times 3/4, which also scales the logit term although the output
layer is never recomputed: it counts ``4.5 B s h V`` where forward plus backward is
``6 B s h V``. :func:`step_flops` counts the latter (0.1-0.4% more for these models).

:func:`step_flops` counts the same terms from a :class:`ModelSpec`, so it also covers
grouped-query attention and gated MLPs; for the Megatron GPT it equals the closed forms, which
``tests/planner/test_flops.py`` checks.
"""

from __future__ import annotations

from slipstream.planner.layout import Recompute
from slipstream.planner.model import ModelSpec

__all__ = ["megatron_flops", "model_flops", "step_flops"]


def megatron_flops(
    batch: int, seq: int, layers: int, hidden: int, vocab: int, *, recompute: bool
) -> float:
    """The closed form ``{72|96} B s l h^2 (1 + s/(6h) + V/(16 l h))`` (Narayanan et al. 2021)."""
    factor = 96.0 if recompute else 72.0
    b, s, n, h, v = batch, seq, layers, hidden, vocab
    return factor * b * s * n * h * h * (1 + s / (6 * h) + v / (16 * n * h))


def step_flops(model: ModelSpec, batch: int, recompute: Recompute = "none") -> float:
    """FLOPs executed for ``batch`` sequences, recomputation included (hardware FLOPs)."""
    layer = model.forward_flops_per_layer(batch)
    extra = {"none": 0.0, "selective": model.attention_core_flops_per_layer(batch), "full": layer}
    logits = model.logits_forward_flops(batch)
    return model.layers * (3 * layer + extra[recompute]) + 3 * logits


def model_flops(model: ModelSpec, batch: int) -> float:
    """FLOPs the model needs, recomputation not counted (for MFU, Chowdhery et al. 2022)."""
    return step_flops(model, batch, "none")
