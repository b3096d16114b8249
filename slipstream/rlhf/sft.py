"""DeepSpeed-Chat step 1, supervised fine-tuning: causal-LM cross-entropy on
``prompt + chosen`` (prompt included), on a slipstream engine.

Yao et al. 2023 (arXiv 2308.01320) and DeepSpeedExamples' ``applications/DeepSpeed-Chat``.
The model is a Hugging Face causal LM or slipstream's reference
:class:`~slipstream.models.gpt.GPT`; both go through :mod:`slipstream.rlhf.policy`.
"""

from __future__ import annotations

import torch
from torch import nn

from slipstream.rlhf.data import SFTBatch
from slipstream.rlhf.losses import causal_lm_loss
from slipstream.rlhf.policy import masked_forward, micro_batches, output_logits
from slipstream.runtime.engine import Engine

__all__ = ["lm_batch_loss", "sft_step"]


def sft_step(engine: Engine, batch: SFTBatch) -> float:
    """One step-1 optimizer step (``gradient_accumulation_steps`` micro-batches); returns
    the mean loss (:func:`~slipstream.rlhf.losses.causal_lm_loss` on the model's logits, so
    a Hugging Face LM and the reference GPT train alike)."""
    gas = engine.gradient_accumulation_steps()
    total = 0.0
    for rows in micro_batches(batch.input_ids.shape[0], gas, "sft_step"):
        loss = lm_batch_loss(engine, batch, rows)
        engine.backward(loss)
        engine.step()
        total += float(loss.detach()) / gas
    return total


def lm_batch_loss(
    model: nn.Module, batch: SFTBatch, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """:func:`~slipstream.rlhf.losses.causal_lm_loss` of ``model`` on ``batch`` (its
    ``rows``); the step-1 loss and PPO's PTX term."""
    ids, mask, labels = batch.input_ids, batch.attention_mask, batch.labels
    if rows is not None:
        ids, mask, labels = ids[rows], mask[rows], labels[rows]
    return causal_lm_loss(output_logits(masked_forward(model, ids, mask)), labels)
