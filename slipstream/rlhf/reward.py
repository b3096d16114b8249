"""DeepSpeed-Chat step 2, the reward model: the base transformer of a causal LM plus
``v_head`` (Linear(hidden, 1, no bias)), a scalar per token, trained with the
divergent-suffix pairwise loss (:func:`~slipstream.rlhf.losses.reward_model_loss`); the score
of a sequence is the value at its last non-pad token.

Yao et al. 2023 (arXiv 2308.01320) and DeepSpeedExamples' ``applications/DeepSpeed-Chat``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from slipstream.models.gpt import GPT
from slipstream.rlhf.data import PairBatch
from slipstream.rlhf.losses import RewardModelOutput, reward_model_loss
from slipstream.rlhf.policy import masked_forward, micro_batches
from slipstream.runtime.engine import Engine

__all__ = ["RewardModel", "reward_step", "sequence_scores"]


class RewardModel(nn.Module):
    """A causal LM's base transformer with a scalar ``v_head`` per token (DeepSpeed-Chat's
    ``RewardModel``; its LM head is dropped).

    Args:
        lm: a Hugging Face causal LM (``base_model`` is its transformer), a base model, or
            slipstream's :class:`~slipstream.models.gpt.GPT` (its ``lm_head`` is replaced by
            the identity, in place, so its forward gives the last hidden states).
    """

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        cfg: Any = lm.config
        self.config = cfg
        self.hf = not isinstance(lm, GPT)
        if isinstance(lm, GPT):
            lm.lm_head = nn.Identity()  # type: ignore[assignment]
            self.backbone: nn.Module = lm
        else:
            self.backbone = getattr(lm, "base_model", lm)
        self.v_head = nn.Linear(int(cfg.hidden_size), 1, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Values ``[B, T]``, one per token."""
        kwargs: dict[str, Any] = {"attention_mask": attention_mask, "position_ids": position_ids}
        if self.hf:
            kwargs["use_cache"] = False
        out = self.backbone(input_ids=input_ids, **kwargs)
        if isinstance(out, torch.Tensor):
            hidden = out
        else:
            hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        values: torch.Tensor = self.v_head(hidden).squeeze(-1)
        return values


def reward_step(
    engine: Engine, batch: PairBatch, pad_token_id: int, num_padding_at_beginning: int = 0
) -> RewardModelOutput:
    """One step-2 optimizer step: chosen and rejected as one batch (``[all chosen; all
    rejected]``, as DeepSpeed-Chat), the divergent-suffix loss. Returns the loss, scores and
    accuracy (detached; means over micro-batches for loss and accuracy)."""
    n, gas = batch.chosen_ids.shape[0], engine.gradient_accumulation_steps()
    losses, accs, chosen, rejected = [], [], [], []
    for rows in micro_batches(n, gas, "reward_step"):
        ids = torch.cat([batch.chosen_ids[rows], batch.rejected_ids[rows]])
        mask = torch.cat([batch.chosen_mask[rows], batch.rejected_mask[rows]])
        # No position ids, as DeepSpeed-Chat: the rows are right-padded (real tokens sit at
        # 0..n-1 either way), and the divergent-suffix loss also reads padding positions.
        values = engine(input_ids=ids, attention_mask=mask)
        k = rows.numel()
        out = reward_model_loss(
            values[:k], values[k:], ids[:k], ids[k:], pad_token_id, num_padding_at_beginning
        )
        engine.backward(out.loss)
        engine.step()
        losses.append(out.loss.detach())
        accs.append(out.accuracy)
        chosen.append(out.chosen_scores.detach())
        rejected.append(out.rejected_scores.detach())
    return RewardModelOutput(
        loss=torch.stack(losses).mean(),
        chosen_scores=torch.cat(chosen),
        rejected_scores=torch.cat(rejected),
        accuracy=torch.stack(accs).mean(),
    )


def sequence_scores(reward_model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each sequence's score ``[B]``: the reward model's value at its last non-pad token.
    Position ids count real tokens, so left padding does not shift them."""
    values = masked_forward(reward_model, ids, mask)
    last = mask.shape[1] - 1 - mask.flip(1).argmax(1)
    return values[torch.arange(ids.shape[0]), last]
