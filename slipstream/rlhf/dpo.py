"""Offline DPO on preference pairs (Rafailov et al. 2023) on a slipstream engine.

No generation and no reward model: each step takes pairs (:class:`~slipstream.rlhf.data.PairBatch`),
sums the answer tokens' log-probabilities under the policy (the engine) and under a frozen
reference, and minimizes :func:`~slipstream.rlhf.losses.dpo_loss`. The chosen and rejected
sequences go through the model as one batch, so one forward and one backward serve both.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from slipstream._logging import log_rank0
from slipstream.config import ConfigError
from slipstream.distributed import comm
from slipstream.rlhf.data import PairBatch
from slipstream.rlhf.losses import dpo_loss
from slipstream.rlhf.policy import causal_lm_logits, micro_batches, selective_log_softmax
from slipstream.rlhf.step_log import log_step_metrics
from slipstream.runtime.engine import Engine

__all__ = ["DPOConfig", "DPOMetrics", "DPOTrainer", "answer_logprob_sums"]


@dataclass(frozen=True)
class DPOConfig:
    beta: float = 0.1
    """Strength of the implicit KL to the reference (the paper's beta; TRL's default)."""

    def __post_init__(self) -> None:
        if self.beta <= 0:
            raise ConfigError(f"DPOConfig.beta={self.beta} must be > 0")


@dataclass(frozen=True)
class DPOMetrics:
    """One step on this rank's pairs (means over the pairs)."""

    step: int
    loss: float
    chosen_reward: float
    """``beta (log pi - log pi_ref)`` of the chosen answers."""
    rejected_reward: float
    margin: float
    """chosen_reward - rejected_reward."""
    accuracy: float
    """Share of pairs whose chosen answer has the larger implicit reward."""
    train_s: float


def answer_logprob_sums(
    model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, answer: torch.Tensor
) -> torch.Tensor:
    """``sum_t answer[t] log p(ids[t] | ids[<t])`` per row, ``[B]``: the log-probability of
    each sequence's answer under ``model`` (a causal LM; ``answer`` marks answer tokens).
    Position ids count real tokens (:mod:`~slipstream.rlhf.policy`), so a left-padded pair
    scores as its right-padded copy does."""
    logp = selective_log_softmax(causal_lm_logits(model, ids, mask), ids[:, 1:])
    return (logp * answer[:, 1:].to(logp.dtype)).sum(1)


class DPOTrainer:
    """DPO on an engine (the policy, any ZeRO stage) against a frozen reference.

    Args:
        engine: from ``slipstream.initialize``; its module a causal LM.
        reference: the frozen starting policy (e.g. ``copy.deepcopy(model)`` before
            ``initialize``), kept in eval mode without gradients.
        config: :class:`DPOConfig`.
        log_path: a JSON-lines file rank 0 appends every step's metrics to.
    """

    def __init__(
        self,
        engine: Engine,
        reference: nn.Module,
        config: DPOConfig | None = None,
        log_path: str | Path | None = None,
    ) -> None:
        self.engine, self.reference = engine, reference.eval().requires_grad_(False)
        self.config = config or DPOConfig()
        self.log_path = Path(log_path) if log_path is not None else None
        self.steps = 0

    def step(self, batch: PairBatch) -> DPOMetrics:
        """One optimizer step on ``batch``, in ``gradient_accumulation_steps`` micro-batches."""
        engine, started = self.engine, time.perf_counter()
        gas = engine.gradient_accumulation_steps()
        n = batch.chosen_ids.shape[0]
        chunks = micro_batches(n, gas, "DPOTrainer", "pairs")
        ids = torch.cat([batch.chosen_ids, batch.rejected_ids])
        mask = torch.cat([batch.chosen_mask, batch.rejected_mask])
        answer = torch.cat([batch.chosen_answer, batch.rejected_answer])
        engine.train()
        sums = torch.zeros(5)
        for rows in chunks:
            both = torch.cat([rows, rows + n])  # the chosen rows, then their rejected rows
            with torch.no_grad():
                ref = answer_logprob_sums(self.reference, ids[both], mask[both], answer[both])
            pol = answer_logprob_sums(engine, ids[both], mask[both], answer[both])
            k = rows.numel()
            out = dpo_loss(pol[:k], pol[k:], ref[:k], ref[k:], beta=self.config.beta)
            engine.backward(out.loss)
            engine.step()
            chosen, rejected = out.chosen_rewards.mean(), out.rejected_rewards.mean()
            sums += (
                torch.stack([out.loss.detach(), chosen, rejected, chosen - rejected, out.accuracy])
                / gas
            )
        self.steps += 1
        loss, chosen_r, rejected_r, margin, accuracy = sums.tolist()
        metrics = DPOMetrics(
            self.steps, loss, chosen_r, rejected_r, margin, accuracy, time.perf_counter() - started
        )
        self._log(metrics)
        return metrics

    def _log(self, m: DPOMetrics) -> None:
        if comm.get_rank() != 0:
            return
        log_rank0(
            "dpo step %d: loss %.4f margin %.4f (chosen %.4f rejected %.4f) accuracy %.2f | %.2fs",
            m.step, m.loss, m.margin, m.chosen_reward, m.rejected_reward, m.accuracy, m.train_s,
        )  # fmt: skip
        log_step_metrics(self.engine, "dpo", m, self.log_path)
