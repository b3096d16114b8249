"""DeepSpeed-Chat step 3, PPO, on slipstream engines (steps 1 and 2: :mod:`.sft`,
:mod:`.reward`; all three chained by ``slipstream chat``: :mod:`.e2e`).

Yao et al. 2023 (arXiv 2308.01320) and DeepSpeedExamples' ``applications/DeepSpeed-Chat``.
:class:`PPOTrainer` drives four models: the actor (trained, generation through the hybrid
engine), a frozen reference (the SFT model), the critic (trained, initialized from the reward
model) and the frozen reward model. One step = ``generate_experience`` then ``train_rlhf``
(DeepSpeed-Chat's names): KL-shaped per-token rewards (beta 0.1, score clip +-5), GAE (gamma
1, lambda 0.95, no whitening), one clipped actor step (0.2) and one clipped critic step (0.2),
then the optional EMA of the actor (0.992). Options: the PTX term (an LM loss on pretraining
text, ``ptx_coef`` x, added to the actor's loss) and ``align_overflow`` (when the actor's or
the critic's gradients overflow, both skip). Every model call goes through
:mod:`slipstream.rlhf.policy`.

The models are Hugging Face causal LMs or slipstream's reference
:class:`~slipstream.models.gpt.GPT` (its forward returns the logits tensor; it has no pad or
EOS ids of its own, so :class:`PPOTrainer` takes them as arguments).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from slipstream._logging import log_rank0
from slipstream.config import ConfigError
from slipstream.distributed import comm
from slipstream.inference.request import trainer_request
from slipstream.rlhf.advantages import ema_update_, gae_advantages_and_returns, kl_shaped_rewards
from slipstream.rlhf.data import SFTBatch
from slipstream.rlhf.grpo import completion_mask
from slipstream.rlhf.losses import ppo_actor_loss, ppo_critic_loss
from slipstream.rlhf.policy import (
    causal_lm_logits,
    clip_fraction,
    entropy_from_logits,
    masked_forward,
    masked_mean,
    sampling_seed,
    selective_log_softmax,
)
from slipstream.rlhf.reward import sequence_scores
from slipstream.rlhf.sft import lm_batch_loss
from slipstream.rlhf.step_log import log_step_metrics
from slipstream.runtime.engine import Engine
from slipstream.zero import GatheredParameters

__all__ = ["Experience", "PPOConfig", "PPOMetrics", "PPOTrainer"]


@dataclass(frozen=True)
class PPOConfig:
    """Step-3 options; the defaults are DeepSpeed-Chat's (current master)."""

    max_new_tokens: int = 256
    kl_coef: float = 0.1
    """beta of the KL folded into the per-token rewards (fixed, no adaptive controller)."""
    clip_reward: float = 5.0
    clip: float = 0.2
    """Policy ratio clip."""
    value_clip: float = 0.2
    gamma: float = 1.0
    lam: float = 0.95
    ema_beta: float = 0.992
    do_sample: bool = True
    temperature: float = 1.0
    seed: int = 0
    ptx_coef: float = 27.8
    """Weight of the PTX term (the LM loss on a pretraining batch passed to :meth:`PPOTrainer.step`)
    in the actor's loss; DeepSpeed-Chat's ``unsup_coef`` default (InstructGPT's gamma)."""
    align_overflow: bool = False
    """When the actor's or the critic's gradients are not finite (an fp16 overflow), skip both
    steps (DeepSpeed-Chat's ``--align_overflow``); else each engine skips only its own."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 2:
            raise ConfigError(
                f"PPOConfig.max_new_tokens={self.max_new_tokens}: answers of <= 1 token are "
                "dropped, so at least 2 are needed"
            )
        if self.kl_coef < 0 or self.clip <= 0 or self.value_clip <= 0 or self.clip_reward <= 0:
            raise ConfigError(
                f"PPOConfig: kl_coef={self.kl_coef} must be >= 0 and clip={self.clip}, "
                f"value_clip={self.value_clip}, clip_reward={self.clip_reward} > 0"
            )
        if not self.ptx_coef >= 0.0:
            raise ConfigError(f"PPOConfig.ptx_coef={self.ptx_coef} must be >= 0")
        if not 0.0 <= self.ema_beta < 1.0:
            raise ConfigError(f"PPOConfig.ema_beta={self.ema_beta} must be in [0, 1)")


@dataclass
class Experience:
    """One generated batch scored with no gradient (DeepSpeed-Chat's ``generate_experience``).

    Per-token arrays are ``[B, L - 1]``: position ``t`` scores token ``t + 1``.
    """

    seq: torch.Tensor
    attention_mask: torch.Tensor
    prompt_len: int
    logprobs: torch.Tensor
    ref_logprobs: torch.Tensor
    values: torch.Tensor
    rewards: torch.Tensor
    """``[B]`` the reward model's score of each sequence."""
    reused: bool = False
    """True when every answer of this step's batch was empty and the previous batch was
    reused (DeepSpeed-Chat's behaviour)."""


@dataclass(frozen=True)
class PPOMetrics:
    step: int
    reward_mean: float
    reward_std: float
    kl: float
    """Mean per-token ``logp - logp_ref`` on the answers."""
    actor_loss: float
    critic_loss: float
    entropy: float
    clip_fraction: float
    response_length: float
    dropped: int
    """Answers of <= 1 token dropped from this step's batch."""
    reused_batch: bool
    generate_s: float
    score_s: float
    train_s: float
    tokens_per_s: float
    ptx_loss: float | None = None
    """The PTX batch's LM loss (None without a PTX batch)."""
    skipped: bool = False
    """The actor's or the critic's optimizer step was skipped (non-finite gradients, or
    ``align_overflow`` after the other one's)."""


class PPOTrainer:
    """DeepSpeed-Chat step 3 on slipstream engines.

    Args:
        actor: engine of the SFT model with ``hybrid_engine.enabled`` (generation).
        critic: engine of a :class:`RewardModel` initialized from the trained reward model.
        reference: the frozen SFT model (a plain module; may live on CPU).
        reward_model: the frozen trained :class:`RewardModel` (a plain module).
        config: :class:`PPOConfig`.
        ema: an optional copy of the actor's module (``copy.deepcopy(model)`` before
            ``initialize``): after each step ``theta_ema <- lerp(theta, theta_ema, beta)``.
        log_path: JSON-lines file rank 0 appends each step's metrics to.
        pad_token_id, eos_token_id: the tokenizer's (default: the actor's ``config``; the
            reference GPT has none, so pass them).
    """

    def __init__(
        self,
        actor: Engine,
        critic: Engine,
        reference: nn.Module,
        reward_model: nn.Module,
        config: PPOConfig | None = None,
        ema: nn.Module | None = None,
        log_path: str | Path | None = None,
        pad_token_id: int | None = None,
        eos_token_id: int | list[int] | None = None,
    ) -> None:
        if getattr(actor, "hybrid_engine", None) is None:
            raise ConfigError(
                "PPOTrainer: the actor engine needs the hybrid engine for generation: add "
                '"hybrid_engine": {"enabled": true} to the actor\'s config'
            )
        self.actor, self.critic, self.config = actor, critic, config or PPOConfig()
        self.reference = reference.eval().requires_grad_(False)
        self.reward_model = reward_model.eval().requires_grad_(False)
        self.ema = ema.eval().requires_grad_(False) if ema is not None else None
        cfg: Any = actor.module.config
        eos = eos_token_id if eos_token_id is not None else getattr(cfg, "eos_token_id", None)
        if eos is None:
            raise ConfigError(
                f"PPOTrainer: the actor ({type(actor.module).__name__}) has no eos_token_id in "
                "its config; pass eos_token_id= (the tokenizer's)"
            )
        self.eos_token_ids = [int(e) for e in (eos if isinstance(eos, list) else [eos])]
        pad = pad_token_id if pad_token_id is not None else getattr(cfg, "pad_token_id", None)
        self.pad_token_id = int(pad if pad is not None else 0)
        self.log_path = Path(log_path) if log_path is not None else None
        self.steps = 0
        self._previous: Experience | None = None
        self._timing = (0.0, 0.0)  # the last experience's (generation, scoring) seconds

    # ------------------------------------------------------------ experience
    def generate_experience(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor
    ) -> tuple[Experience | None, int]:
        """Generate answers to the (left-padded) prompts and score them with no gradient.

        Answers of <= 1 token are dropped. When every answer of some rank's batch is dropped,
        every rank reuses its previous batch's experience (marked ``reused``; DeepSpeed-Chat
        reuses the previous batch too), or returns None with none yet: the decision is taken
        together, so the ranks keep making the same model calls (collectives under ZeRO-3).
        Returns ``(experience, dropped answers)``.
        """
        cfg, p = self.config, prompt_ids.shape[1]
        started = time.perf_counter()
        self.actor.eval()
        request = trainer_request(
            self.actor.module,
            prompt_ids,
            prompt_mask,
            max_new_tokens=cfg.max_new_tokens,
            do_sample=cfg.do_sample,
            temperature=cfg.temperature,
            top_k=None,
            eos_token_ids=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            seed=sampling_seed(cfg.seed, self.steps, comm.get_rank()),
        )
        seq = self.actor.hybrid_engine.run(request)
        self.actor.train()
        generated = time.perf_counter()
        self._timing = (generated - started, 0.0)
        answer = completion_mask(seq[:, p:], self.eos_token_ids)
        keep = answer.sum(1) > 1
        dropped = int((~keep).sum())
        if not comm.all_true(bool(keep.any()), label="ppo_experience"):
            if self._previous is None:
                return None, dropped
            self._previous.reused = True
            return self._previous, dropped
        seq, answer, pmask = seq[keep], answer[keep], prompt_mask[keep]
        seq = seq.masked_fill(torch.cat([pmask, answer], 1) == 0, self.pad_token_id)
        mask = torch.cat([pmask, answer], 1)
        with torch.no_grad():
            logp = selective_log_softmax(causal_lm_logits(self.actor, seq, mask), seq[:, 1:])
            ref = selective_log_softmax(causal_lm_logits(self.reference, seq, mask), seq[:, 1:])
            values = masked_forward(self.critic, seq, mask)[:, :-1]
            scores = sequence_scores(self.reward_model, seq, mask)
        exp = Experience(seq, mask, p, logp, ref, values.float(), scores.float())
        self._previous = exp
        self._timing = (generated - started, time.perf_counter() - generated)
        return exp, dropped

    # ------------------------------------------------------------ training
    def train_rlhf(self, exp: Experience, ptx: SFTBatch | None = None) -> dict[str, Any]:
        """One actor step and one critic step on ``exp`` (DeepSpeed-Chat's ``train_rlhf``).

        With ``ptx`` (a batch of pretraining text), the actor's loss is
        ``ppo_actor_loss + ptx_coef * LM loss(ptx)``, one backward and one step
        (InstructGPT's objective; DeepSpeed-Chat takes a separate step on the PTX term).
        With ``align_overflow`` both backward passes run first, then both steps, and a
        model whose gradients overflow makes the other skip its step too.
        """
        cfg = self.config
        start = exp.prompt_len - 1
        action_mask = exp.attention_mask[:, 1:].to(exp.logprobs.dtype)
        with torch.no_grad():
            rewards, ends = kl_shaped_rewards(
                exp.logprobs, exp.ref_logprobs, exp.rewards, action_mask, start,
                cfg.kl_coef, cfg.clip_reward,
            )  # fmt: skip
            positions = torch.arange(rewards.shape[1]).unsqueeze(0)
            old_values = exp.values.masked_fill(positions >= ends.unsqueeze(1), 0.0)
            advantages, returns = gae_advantages_and_returns(
                old_values, rewards, start, cfg.gamma, cfg.lam
            )
        mask = action_mask[:, start:]
        logits = causal_lm_logits(self.actor, exp.seq, exp.attention_mask)
        logp = selective_log_softmax(logits, exp.seq[:, 1:])
        actor_loss = ppo_actor_loss(
            logp[:, start:], exp.logprobs[:, start:], advantages, mask, cfg.clip
        )
        ptx_loss = lm_batch_loss(self.actor, ptx) if ptx is not None else None
        total = actor_loss if ptx_loss is None else actor_loss + cfg.ptx_coef * ptx_loss
        self.actor.backward(total)
        if not cfg.align_overflow:
            self.actor.step()
        values = masked_forward(self.critic, exp.seq, exp.attention_mask)[:, :-1]
        critic_loss = ppo_critic_loss(
            values[:, start:], old_values[:, start:], returns, mask, cfg.value_clip
        )
        self.critic.backward(critic_loss)
        if cfg.align_overflow:
            self._align_overflow()
            self.actor.step()
        self.critic.step()
        skipped = not (self.actor.was_step_applied() and self.critic.was_step_applied())
        if self.ema is not None:
            self._update_ema()
        with torch.no_grad():
            entropy = entropy_from_logits(logits[:, start:])
            ratio = torch.exp(logp[:, start:] - exp.logprobs[:, start:])
            kl = exp.logprobs[:, start:] - exp.ref_logprobs[:, start:]
        return {
            "ptx_loss": None if ptx_loss is None else float(ptx_loss.detach()),
            "skipped": skipped,
            "actor_loss": float(actor_loss.detach()),
            "critic_loss": float(critic_loss.detach()),
            "entropy": float(masked_mean(entropy, mask)),
            "clip_fraction": float(clip_fraction(ratio, cfg.clip, mask)),
            "kl": float(masked_mean(kl, mask)),
        }

    def _align_overflow(self) -> None:
        """Before either steps: when one model's gradients overflow, make the other skip too
        (the overflowing one skips by itself). Only on an accumulation boundary, where the
        steps happen; the checks are collectives every rank makes."""
        if not (
            self.actor.is_gradient_accumulation_boundary()
            and self.critic.is_gradient_accumulation_boundary()
        ):
            return
        actor_opt, critic_opt = self.actor.optimizer, self.critic.optimizer
        assert actor_opt is not None and critic_opt is not None
        actor_bad, critic_bad = actor_opt.gradients_overflow(), critic_opt.gradients_overflow()
        if actor_bad != critic_bad:
            log_rank0(
                "ppo: the %s's gradients overflowed; align_overflow skips the %s's step too",
                "actor" if actor_bad else "critic", "critic" if actor_bad else "actor",
            )  # fmt: skip
            (critic_opt if actor_bad else actor_opt).skip_step = True

    def _update_ema(self) -> None:
        """``theta_ema <- lerp(theta, theta_ema, beta)``; ZeRO-3 parameters are gathered for
        the update (every rank takes part) and released after."""
        assert self.ema is not None
        params = list(self.actor.module.parameters())
        with torch.no_grad(), GatheredParameters(params):
            ema_update_(list(self.ema.parameters()), list(params), self.config.ema_beta)

    def step(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, ptx: SFTBatch | None = None
    ) -> PPOMetrics | None:
        """``generate_experience`` then ``train_rlhf`` (with the PTX batch ``ptx``, if any).
        Returns None (and trains nothing, on every rank) when some rank has no experience yet
        (all its first answers empty)."""
        exp, dropped = self.generate_experience(prompt_ids, prompt_mask)
        t1 = time.perf_counter()
        if not comm.all_true(exp is not None, label="ppo_experience"):
            log_rank0(
                "ppo: every answer of a rank's first batch had <= 1 token; step skipped on "
                "all ranks (nothing to reuse yet)"
            )
            return None
        assert exp is not None
        losses = self.train_rlhf(exp, ptx)
        t2 = time.perf_counter()
        self.steps += 1
        n_tokens = int(exp.attention_mask[:, exp.prompt_len :].sum())
        generate_s, score_s = self._timing
        metrics = PPOMetrics(
            step=self.steps,
            reward_mean=float(exp.rewards.mean()),
            reward_std=float(exp.rewards.std()) if exp.rewards.numel() > 1 else 0.0,
            kl=losses["kl"],
            actor_loss=losses["actor_loss"],
            critic_loss=losses["critic_loss"],
            entropy=losses["entropy"],
            clip_fraction=losses["clip_fraction"],
            response_length=n_tokens / exp.seq.shape[0],
            dropped=dropped,
            reused_batch=exp.reused,
            generate_s=generate_s,
            score_s=score_s,
            train_s=t2 - t1,
            tokens_per_s=n_tokens / max(generate_s, 1e-9),
            ptx_loss=losses["ptx_loss"],
            skipped=losses["skipped"],
        )
        self._log(metrics)
        return metrics

    def _log(self, m: PPOMetrics) -> None:
        if comm.get_rank() != 0:
            return
        log_rank0(
            "ppo step %d: reward %.3f +- %.3f kl %.4f actor %.4f critic %.4f len %.1f | "
            "generate %.2fs score %.2fs train %.2fs",
            m.step, m.reward_mean, m.reward_std, m.kl, m.actor_loss, m.critic_loss,
            m.response_length, m.generate_s, m.score_s, m.train_s,
        )  # fmt: skip
        log_step_metrics(self.actor, "ppo", m, self.log_path)
