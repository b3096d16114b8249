"""GRPO / RLOO: critic-free policy optimization on the hybrid engine.

Group Relative Policy Optimization (Shao et al. 2024, DeepSeekMath section 4.1): sample
``group_size`` answers per prompt, score each with a reward (here any Python callable, e.g. a
rule a program can check), use the group-normalized reward as every token's advantage, and
maximize the clipped surrogate minus ``kl_coef`` times the k3 KL estimate to a frozen
reference. ``estimator="rloo"`` uses REINFORCE leave-one-out advantages (Ahmadian et al.
2024) instead. No value model, no reward model needed.

One :meth:`GRPOTrainer.step` = generate (``engine.eval()``, ``engine.generate``: the hybrid
engine gathers ZeRO-3 parameters once), score, then ``updates_per_batch`` optimizer steps on
the batch (``engine.train()``). Every rank passes its own prompts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from slipstream._logging import log_rank0
from slipstream.config import ConfigError
from slipstream.distributed import comm
from slipstream.inference.request import trainer_request
from slipstream.rlhf.advantages import grpo_advantages, rloo_advantages
from slipstream.rlhf.losses import grpo_loss
from slipstream.rlhf.policy import (
    answer_logprobs,
    clip_fraction,
    entropy_from_logits,
    masked_mean,
    micro_batches,
    ragged_answer_logprobs,
    sampling_seed,
)
from slipstream.rlhf.step_log import log_step_metrics
from slipstream.runtime.engine import Engine

__all__ = ["GRPOConfig", "GRPOMetrics", "GRPOTrainer", "RewardFn", "completion_mask"]

RewardFn = Callable[[list[list[int]], list[list[int]]], Sequence[float] | torch.Tensor]
"""``reward_fn(prompts, completions) -> one score per completion``: token-id lists, the
prompt without padding and the completion up to (not including) its EOS."""


@dataclass(frozen=True)
class GRPOConfig:
    """Options of :class:`GRPOTrainer` (defaults follow TRL's ``GRPOConfig`` where it has one)."""

    group_size: int = 4
    """Answers sampled per prompt (>= 2)."""
    max_new_tokens: int = 16
    """Longest answer generated."""
    temperature: float = 1.0
    """Sampling temperature of generation, and of scoring: the policy's, the old policy's and
    the reference's log-probabilities (and the entropy) are taken from the logits divided by
    it, so the ratio and the KL are those of the distribution the answers were drawn from
    (TRL's ``GRPOTrainer`` does the same). At 1 (the default) nothing is divided."""
    top_k: int | None = None
    """Sample from the k most likely tokens only (None: all)."""
    clip: float = 0.2
    """PPO ratio clip epsilon."""
    kl_coef: float = 0.04
    """Weight of the k3 KL to the reference (0: no reference model needed)."""
    estimator: Literal["grpo", "rloo"] = "grpo"
    """Group advantage: normalized by the group's std (GRPO) or leave-one-out (RLOO)."""
    updates_per_batch: int = 1
    """Optimizer steps on each generated batch (TRL's ``num_iterations``)."""
    seed: int = 0
    """Seed of sampling (offset by the step and the rank)."""

    def __post_init__(self) -> None:
        if self.group_size < 2:
            raise ConfigError(
                f"GRPOConfig.group_size={self.group_size}: group advantages need at least 2 "
                "answers per prompt; set group_size >= 2"
            )
        for name in ("max_new_tokens", "updates_per_batch"):
            if getattr(self, name) < 1:
                raise ConfigError(f"GRPOConfig.{name}={getattr(self, name)} must be >= 1")
        if self.temperature <= 0 or self.kl_coef < 0 or self.clip <= 0:
            raise ConfigError(
                f"GRPOConfig: temperature={self.temperature} must be > 0, kl_coef="
                f"{self.kl_coef} >= 0 and clip={self.clip} > 0"
            )


@dataclass(frozen=True)
class GRPOMetrics:
    """What one step measured (this rank's batch; the loss terms averaged over updates)."""

    step: int
    reward_mean: float
    reward_std: float
    kl: float
    """Mean per-token k3 KL to the reference (0 without one)."""
    entropy: float
    """Mean per-token entropy of the policy on the answers."""
    clip_fraction: float
    """Share of answer tokens whose ratio was clipped (0 with one update per batch)."""
    response_length: float
    generate_s: float
    score_s: float
    train_s: float
    tokens_per_s: float
    """Generated tokens per second of generation."""


def completion_mask(completions: torch.Tensor, eos_token_ids: Sequence[int]) -> torch.Tensor:
    """1 on each answer's tokens up to and including its first EOS, 0 after (padding)."""
    is_eos = torch.isin(completions, torch.tensor(list(eos_token_ids), dtype=completions.dtype))
    before = is_eos.long().cumsum(1) - is_eos.long()  # EOS seen strictly before this token
    return (before == 0).long()


class GRPOTrainer:
    """GRPO (or RLOO) on a slipstream engine with the hybrid engine enabled.

    Args:
        engine: from ``slipstream.initialize`` with ``hybrid_engine.enabled`` (the actor).
        reward_fn: scores completions (see :data:`RewardFn`).
        config: :class:`GRPOConfig`.
        reference: a frozen copy of the initial actor for the KL term (needed when
            ``config.kl_coef`` > 0); kept in eval mode without gradients.
        log_path: a JSON-lines file rank 0 appends every step's metrics to.
    """

    def __init__(
        self,
        engine: Engine,
        reward_fn: RewardFn,
        config: GRPOConfig | None = None,
        reference: nn.Module | None = None,
        log_path: str | Path | None = None,
    ) -> None:
        self.config = config or GRPOConfig()
        if getattr(engine, "hybrid_engine", None) is None:
            raise ConfigError(
                "GRPOTrainer needs an engine with the hybrid engine: add "
                '"hybrid_engine": {"enabled": true} to the config passed to slipstream.initialize'
            )
        if self.config.kl_coef > 0 and reference is None:
            raise ConfigError(
                f"GRPOConfig.kl_coef={self.config.kl_coef} needs reference= (a frozen copy of "
                "the initial actor, e.g. copy.deepcopy(model) before initialize); or set "
                "kl_coef=0"
            )
        self.engine, self.reward_fn, self.reference = engine, reward_fn, reference
        if reference is not None:
            reference.eval().requires_grad_(False)
        model_cfg: Any = engine.module.config
        self.pad_token_id = int(model_cfg.pad_token_id if model_cfg.pad_token_id is not None else 0)
        eos = model_cfg.eos_token_id
        self.eos_token_ids = [int(e) for e in (eos if isinstance(eos, list) else [eos])]
        self.log_path = Path(log_path) if log_path is not None else None
        self.steps = 0

    # ------------------------------------------------------------------ one step
    def step(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> GRPOMetrics:
        """Generate ``group_size`` answers per (left-padded) prompt, score, update."""
        cfg = self.config
        t0 = time.perf_counter()
        seqs, mask, answer = self.generate(prompt_ids, prompt_mask)
        t1 = time.perf_counter()
        rewards = self.score(prompt_ids, prompt_mask, seqs[:, prompt_ids.shape[1] :], answer)
        estimate = grpo_advantages if cfg.estimator == "grpo" else rloo_advantages
        adv = estimate(rewards, cfg.group_size)
        old, ref = self._frozen_logprobs(seqs, mask, answer)
        t2 = time.perf_counter()
        sums = torch.zeros(3)
        for _ in range(cfg.updates_per_batch):
            sums += self._update(seqs, mask, answer, adv, old, ref)
        t3 = time.perf_counter()
        self.steps += 1
        n_tokens = int(answer.sum())
        kl, entropy, clipped = (sums / cfg.updates_per_batch).tolist()
        metrics = GRPOMetrics(
            step=self.steps,
            reward_mean=float(rewards.mean()),
            reward_std=float(rewards.std()) if rewards.numel() > 1 else 0.0,
            kl=kl,
            entropy=entropy,
            clip_fraction=clipped,
            response_length=n_tokens / answer.shape[0],
            generate_s=t1 - t0,
            score_s=t2 - t1,
            train_s=t3 - t2,
            tokens_per_s=n_tokens / max(t1 - t0, 1e-9),
        )
        self._log(metrics)
        return metrics

    def generate(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sample the group's answers through the hybrid engine.

        Returns ``(sequences [N, P + A], attention mask [N, P + A], answer mask [N, A])``
        with ``N = prompts x group_size``, prompt-major.
        """
        cfg, g = self.config, self.config.group_size
        ids, pmask = prompt_ids.repeat_interleave(g, 0), prompt_mask.repeat_interleave(g, 0)
        self.engine.eval()
        request = trainer_request(
            self.engine.module,
            ids,
            pmask,
            max_new_tokens=cfg.max_new_tokens,
            do_sample=True,
            temperature=cfg.temperature,
            top_k=cfg.top_k,
            eos_token_ids=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            seed=sampling_seed(cfg.seed, self.steps, comm.get_rank()),
        )
        seqs = self.engine.hybrid_engine.run(request)
        self.engine.train()
        answer = completion_mask(seqs[:, ids.shape[1] :], self.eos_token_ids)
        return seqs, torch.cat([pmask, answer], dim=1), answer

    def score(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        completions: torch.Tensor,
        answer: torch.Tensor,
    ) -> torch.Tensor:
        """Call ``reward_fn`` on the prompts (unpadded) and answers (before EOS): ``[N]``."""
        g = self.config.group_size
        prompts = [row[m.bool()].tolist() for row, m in zip(prompt_ids, prompt_mask)]
        prompts = [p for p in prompts for _ in range(g)]
        texts = []
        for row, m in zip(completions, answer):
            tokens = row[m.bool()].tolist()
            texts.append(tokens[:-1] if tokens and tokens[-1] in self.eos_token_ids else tokens)
        rewards = torch.as_tensor(self.reward_fn(prompts, texts), dtype=torch.float32)
        if rewards.shape != (len(texts),):
            raise ValueError(
                f"reward_fn returned shape {tuple(rewards.shape)} for {len(texts)} completions; "
                "return one float per completion"
            )
        return rewards

    # ----------------------------------------------------------------- internals
    def _ragged(self) -> bool:
        """Score in length-sorted chunks, padding left out
        (:func:`~slipstream.rlhf.policy.ragged_answer_logprobs`)? With data parallelism only
        (every rank a data-parallel rank, as ZeRO at any stage): the number of forwards then
        depends on each rank's answers, and the ranks agree on one count
        (:meth:`_agree_forwards`). Tensor, sequence or pipeline parallelism split one
        forward over ranks that must feed it the same shapes: the padded forward."""
        world = comm.get_world_size()
        return world == 1 or self.engine.dp_world_size == world

    @staticmethod
    def _agree_forwards(count: int) -> int:
        """The number of scoring forwards every rank runs: the largest rank's ``count``.

        A forward may hold collectives every rank must call in the same order (ZeRO-3
        gathers each unit's parameters in the forward and again in its backward; an
        expert-parallel MoE layer's all-to-all); ranks with fewer forwards pad with
        one-token ones. Without such collectives (ZeRO 0-2, no experts) the count would
        not need to agree, since gradients are reduced once per backward call and every
        rank calls backward once per micro-batch; the 8-byte all-reduce and the few
        one-token forwards are kept anyway, so the models and configs are not told apart
        here."""
        return comm.max_int(count, label="grpo_scoring_forwards")

    def _logprobs(
        self,
        model: nn.Module,
        seqs: torch.Tensor,
        mask: torch.Tensor,
        answer: torch.Tensor,
        entropy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probabilities ``[N, A]`` of the answer tokens under ``model`` at the sampling
        temperature (see :attr:`GRPOConfig.temperature`), and their entropy (detached)
        when ``entropy``. Positions past an answer's end are not meaningful (masked out)."""
        t = self.config.temperature
        if self._ragged():
            return ragged_answer_logprobs(
                model, seqs, mask, answer, t, entropy=entropy, agree=self._agree_forwards
            )
        logits, logp = answer_logprobs(model, seqs, mask, answer.shape[1], t)
        if not entropy:
            return logp, None
        with torch.no_grad():
            return logp, entropy_from_logits(logits)

    @torch.no_grad()
    def _frozen_logprobs(
        self, seqs: torch.Tensor, mask: torch.Tensor, answer: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Answer log-probabilities under the policy before any update (needed only for
        more than one update per batch; with one, the ratio is taken against the detached
        current values) and under the reference (when ``kl_coef`` > 0)."""
        old = ref = None
        if self.config.updates_per_batch > 1:
            old = self._logprobs(self.engine, seqs, mask, answer)[0]
        if self.reference is not None and self.config.kl_coef > 0:
            ref = self._logprobs(self.reference, seqs, mask, answer)[0]
        return old, ref

    def _update(
        self,
        seqs: torch.Tensor,
        mask: torch.Tensor,
        answer: torch.Tensor,
        adv: torch.Tensor,
        old: torch.Tensor | None,
        ref: torch.Tensor | None,
    ) -> torch.Tensor:
        """One optimizer step over the batch, in ``gradient_accumulation_steps`` micro-batches
        of :func:`~slipstream.rlhf.losses.grpo_loss`. Returns the (KL, entropy, clip
        fraction) token means."""
        cfg, engine = self.config, self.engine
        gas = engine.gradient_accumulation_steps()
        chunks = micro_batches(
            seqs.shape[0], gas, "GRPOTrainer", "answers per step",
            "make prompts x group_size a multiple of it",
        )  # fmt: skip
        stats = torch.zeros(3)
        for rows in chunks:
            m = answer[rows]
            logp, entropy = self._logprobs(engine, seqs[rows], mask[rows], m, entropy=True)
            assert entropy is not None
            out = grpo_loss(
                logp, adv[rows], m,
                old_logprobs=None if old is None else old[rows],
                ref_logprobs=None if ref is None else ref[rows],
                clip=cfg.clip, kl_coef=cfg.kl_coef,
            )  # fmt: skip
            engine.backward(out.loss)
            engine.step()
            with torch.no_grad():
                stats += (
                    torch.stack(
                        [
                            masked_mean(out.kl, m),
                            masked_mean(entropy, m),
                            clip_fraction(out.ratio, cfg.clip, m),
                        ]
                    )
                    / gas
                )
        return stats

    def _log(self, metrics: GRPOMetrics) -> None:
        if comm.get_rank() != 0:
            return
        log_rank0(
            "grpo step %d: reward %.3f +- %.3f kl %.4f entropy %.3f len %.1f | generate %.2fs "
            "score %.2fs train %.2fs | %.0f tokens/s",
            metrics.step,
            metrics.reward_mean,
            metrics.reward_std,
            metrics.kl,
            metrics.entropy,
            metrics.response_length,
            metrics.generate_s,
            metrics.score_s,
            metrics.train_s,
            metrics.tokens_per_s,
        )
        log_step_metrics(self.engine, "grpo", metrics, self.log_path)
