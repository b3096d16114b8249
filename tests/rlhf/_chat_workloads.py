"""Per-rank bodies of the DPO and DeepSpeed-Chat step tests (run in tests/rlhf's 2-rank world).

Task (spec 3.5, shrunk): the prompt is a few digits and ':'; the chosen answer is the digits
sorted, the rejected one a different order. A character tokenizer, a tiny LLaMA.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import nn

from slipstream.rlhf.data import PreferenceRecord

CHARS = " 0123456789:"
PAD, BOS, EOS = 0, 1, 2
VOCAB = 3 + len(CHARS)


class CharTokenizer:
    """One id per character (the data path's Tokenizer protocol)."""

    pad_token_id: int | None = PAD
    eos_token_id: int | None = EOS

    def __init__(self, offset: int = 3) -> None:
        self.offset = offset

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [CHARS.index(c) + self.offset for c in text]


def records(n: int, seed: int) -> list[PreferenceRecord]:
    """``n`` sorting pairs (fields with DeepSpeed-Chat's leading space)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        digits = torch.randint(0, 10, (4,), generator=g).tolist()
        shuffled = digits[:]
        while shuffled == sorted(digits):
            shuffled = [digits[i] for i in torch.randperm(4, generator=g).tolist()]
        text = "".join(map(str, digits))
        out.append(
            PreferenceRecord(
                f" {text}:",
                " " + "".join(map(str, sorted(digits))),
                " " + "".join(map(str, shuffled)),
            )
        )
    return out


def tiny_llama(seed: int = 0) -> nn.Module:
    from tests._tiny_models import tiny_llama as build

    return build(seed, vocab=VOCAB, hidden=32, context=32, eos=EOS, pad=PAD, bos=BOS, eval=False)


def config(stage: int, lr: float, hybrid: bool = False, batch: int = 8) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": batch,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "gradient_clipping": 1.0,
    }
    if hybrid:
        cfg["hybrid_engine"] = {"enabled": True, "max_out_tokens": 32}
    return cfg


def manual_dpo_loss(policy: nn.Module, reference: nn.Module, batch: Any, beta: float) -> float:
    """DPO loss written out token by token, with plain Python sums."""

    def answer_logp(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, ans: torch.Tensor):
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits.double()
        sums = []
        for b in range(ids.shape[0]):
            total = 0.0
            for t in range(1, ids.shape[1]):
                if ans[b, t]:
                    total += float(torch.log_softmax(logits[b, t - 1], -1)[ids[b, t]])
            sums.append(total)
        return sums

    pc = answer_logp(policy, batch.chosen_ids, batch.chosen_mask, batch.chosen_answer)
    pr = answer_logp(policy, batch.rejected_ids, batch.rejected_mask, batch.rejected_answer)
    rc = answer_logp(reference, batch.chosen_ids, batch.chosen_mask, batch.chosen_answer)
    rr = answer_logp(reference, batch.rejected_ids, batch.rejected_mask, batch.rejected_answer)
    losses = []
    for i in range(len(pc)):
        z = beta * ((pc[i] - rc[i]) - (pr[i] - rr[i]))
        losses.append(-math.log(1.0 / (1.0 + math.exp(-z))))
    return sum(losses) / len(losses)


def dpo_checks() -> dict[str, Any]:
    """DPO at ZeRO-2 on 2 ranks (each its own pairs): the reported loss of a batch equals
    the hand-written one; a few steps raise the held-out chosen-vs-rejected margin."""
    import slipstream
    from slipstream.distributed import comm
    from slipstream.rlhf import DPOConfig, DPOTrainer, pair_batch
    from slipstream.rlhf.dpo import answer_logprob_sums

    rank = comm.get_rank()
    tok = CharTokenizer()
    model = tiny_llama()
    reference = copy.deepcopy(model)
    engine, *_ = slipstream.initialize(model=model, config=config(2, 5e-3))
    trainer = DPOTrainer(engine, reference, DPOConfig(beta=0.5))
    held_out = pair_batch(tok, records(16, seed=999 + rank), 12)

    def margin() -> float:
        with torch.no_grad():
            n = held_out.chosen_ids.shape[0]
            pol = [
                answer_logprob_sums(engine.module, ids, m, a)
                for ids, m, a in (
                    (held_out.chosen_ids, held_out.chosen_mask, held_out.chosen_answer),
                    (held_out.rejected_ids, held_out.rejected_mask, held_out.rejected_answer),
                )
            ]
            ref = [
                answer_logprob_sums(reference, ids, m, a)
                for ids, m, a in (
                    (held_out.chosen_ids, held_out.chosen_mask, held_out.chosen_answer),
                    (held_out.rejected_ids, held_out.rejected_mask, held_out.rejected_answer),
                )
            ]
            return float(((pol[0] - ref[0]) - (pol[1] - ref[1])).sum() / n)

    out: dict[str, Any] = {"margin_before": margin(), "metrics": []}
    for step in range(6):
        batch = pair_batch(tok, records(8, seed=step * 13 + rank), 12)
        if step == 3:
            out["manual_loss"] = manual_dpo_loss(engine.module, reference, batch, 0.5)
        out["metrics"].append(trainer.step(batch))
    out["margin_after"] = margin()
    return out


def chat_checks() -> dict[str, Any]:
    """DeepSpeed-Chat's three steps, a few steps each, 2 ranks: SFT (ZeRO-2), reward model
    (ZeRO-2), PPO with the actor and critic at ZeRO-3 (hybrid-engine generation) and EMA."""
    import slipstream
    from slipstream.distributed import comm
    from slipstream.rlhf import (
        PPOConfig,
        PPOTrainer,
        RewardModel,
        pair_batch,
        prompt_batch,
        reward_step,
        sft_batch,
        sft_step,
        split_for_step,
    )

    rank = comm.get_rank()
    tok = CharTokenizer()
    data = records(96, seed=7)
    out: dict[str, Any] = {}

    # step 1: SFT on its 20% share (each rank its own half of every batch)
    sft_data = split_for_step(data, 1)
    actor, *_ = slipstream.initialize(model=tiny_llama(), config=config(2, 1e-2))
    losses = []
    for step in range(8):
        rows = [sft_data[(step * 16 + 2 * i + rank) % len(sft_data)] for i in range(8)]
        losses.append(sft_step(actor, sft_batch(tok, rows, 12)))
    out["sft_losses"] = losses
    sft_state = {k: v.detach().clone() for k, v in actor.module.state_dict().items()}

    # step 2: reward model on its 40% share
    rm_data = split_for_step(data, 2)
    rm, *_ = slipstream.initialize(model=RewardModel(tiny_llama(1)), config=config(2, 1e-2))
    rm_out = []
    for step in range(8):
        rows = [rm_data[(step * 16 + 2 * i + rank) % len(rm_data)] for i in range(8)]
        rm_out.append(reward_step(rm, pair_batch(tok, rows, 12), PAD))
    out["rm_losses"] = [float(o.loss) for o in rm_out]
    out["rm_accuracy"] = [float(o.accuracy) for o in rm_out]
    rm_state = {k: v.detach().clone() for k, v in rm.module.state_dict().items()}

    # step 3: PPO on its 40% share
    def from_sft() -> nn.Module:
        m = tiny_llama()
        m.load_state_dict(sft_state)
        return m

    def from_rm() -> nn.Module:
        m = RewardModel(tiny_llama(1))
        m.load_state_dict(rm_state)
        return m

    reference, reward_model, ema = from_sft(), from_rm(), from_sft()
    ppo_actor, *_ = slipstream.initialize(model=from_sft(), config=config(3, 1e-3, hybrid=True))
    critic, *_ = slipstream.initialize(model=from_rm(), config=config(3, 1e-3))
    trainer = PPOTrainer(
        ppo_actor, critic, reference, reward_model, PPOConfig(max_new_tokens=6), ema=ema
    )
    ppo_data = split_for_step(data, 3)
    metrics = []
    for step in range(3):
        rows = [ppo_data[(step * 8 + 2 * i + rank) % len(ppo_data)] for i in range(4)]
        prompts = prompt_batch(tok, rows, 8)
        metrics.append(trainer.step(prompts.input_ids, prompts.attention_mask))
    out["ppo"] = metrics
    with slipstream.zero.GatheredParameters(list(ppo_actor.module.parameters())):
        actor_now = {n: p.detach().clone() for n, p in ppo_actor.module.named_parameters()}
    out["actor_moved"] = max(float((actor_now[n] - sft_state[n]).abs().max()) for n in actor_now)
    out["reference_kept"] = all(
        torch.equal(p, sft_state[n]) for n, p in reference.named_parameters()
    )
    out["reward_kept"] = all(
        torch.equal(p, rm_state[n]) for n, p in reward_model.named_parameters()
    )
    # EMA after 3 steps: 0.992^3 of the SFT weights plus the rest spread over the actor's
    # trajectory, so it lies strictly between the two, much nearer the start.
    ema_moved = max(float((p - sft_state[n]).abs().max()) for n, p in ema.named_parameters())
    out["ema_moved"] = ema_moved
    return out


def _manual_lm_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """Mean next-token cross-entropy written out token by token (differentiable)."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    terms = []
    for b in range(batch.input_ids.shape[0]):
        for t in range(1, batch.input_ids.shape[1]):
            if batch.labels[b, t] != -100:
                terms.append(-torch.log_softmax(logits[b, t - 1].float(), -1)[batch.labels[b, t]])
    return sum(terms) / len(terms)  # type: ignore[return-value]


def ppo_extras_checks() -> dict[str, Any]:
    """PPO's PTX term and ``align_overflow`` on 2 ranks (actor and critic at ZeRO-2, plain
    SGD without clipping, so an update is ``-lr x gradient``).

    PTX: two actors from the same weights train on the same experience, one with a PTX batch
    (coefficient ``c``); the difference of their new weights must be ``-lr c g``, ``g`` the
    gradient (averaged over the ranks) of the LM loss written out token by token.
    align_overflow: a forward hook makes one model's outputs inf after the experience is
    taken; with the option both models keep their weights, without it the other one steps.
    """
    from dataclasses import replace

    import slipstream
    from slipstream.distributed import comm
    from slipstream.rlhf import PPOConfig, PPOTrainer, RewardModel, prompt_batch, text_batch

    rank, world, lr, coef = comm.get_rank(), comm.get_world_size(), 0.1, 3.0
    tok = CharTokenizer()

    def sgd(hybrid: bool) -> dict[str, Any]:
        cfg = config(2, lr, hybrid=hybrid, batch=4)
        cfg["optimizer"] = {"type": "SGD", "params": {"lr": lr}}
        cfg["gradient_clipping"] = 0.0
        return cfg

    def trainer(align: bool) -> PPOTrainer:
        actor, *_ = slipstream.initialize(model=tiny_llama(), config=sgd(True))
        critic, *_ = slipstream.initialize(model=RewardModel(tiny_llama(1)), config=sgd(False))
        cfg = PPOConfig(max_new_tokens=6, ptx_coef=coef, align_overflow=align)
        return PPOTrainer(actor, critic, tiny_llama(), RewardModel(tiny_llama(1)), cfg)

    def weights(engine: Any) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}

    with_ptx, without = trainer(False), trainer(False)
    prompts = prompt_batch(tok, records(4, seed=50 + rank), 8)
    exp, _ = with_ptx.generate_experience(prompts.input_ids, prompts.attention_mask)
    assert exp is not None, "every answer of the experience batch was empty"
    ptx = text_batch(tok, [r.prompt + r.chosen for r in records(2, seed=70 + rank)], 12)
    start = weights(with_ptx.actor)
    manual_model = tiny_llama()
    manual_loss = _manual_lm_loss(manual_model, ptx)
    manual_loss.backward()
    grads = {n: p.grad.clone() for n, p in manual_model.named_parameters()}
    for g in grads.values():
        comm.all_reduce(g)
        g /= world
    out: dict[str, Any] = {"manual_ptx_loss": float(manual_loss)}
    out["with"] = with_ptx.train_rlhf(exp, ptx)
    out["without"] = without.train_rlhf(exp)
    a, b = weights(with_ptx.actor), weights(without.actor)
    out["ptx_update_error"] = max(
        float(((a[n] - b[n]) - (-lr * coef * grads[n])).abs().max()) for n in a
    )
    out["ptx_update_size"] = max(float((lr * coef * g).abs().max()) for g in grads.values())
    out["start_equal"] = all(torch.equal(start[n], tiny_llama().state_dict()[n]) for n in start)

    def overflow_round(t: PPOTrainer, module: nn.Module) -> dict[str, Any]:
        """One train_rlhf with ``module``'s output made inf: which weights changed."""
        before_a, before_c = weights(t.actor), weights(t.critic)
        hook = module.register_forward_hook(lambda m, i, o: o * float("inf"))
        try:
            losses = t.train_rlhf(exp)
        finally:
            hook.remove()
        after_a, after_c = weights(t.actor), weights(t.critic)
        return {
            "skipped": losses["skipped"],
            "actor_kept": all(torch.equal(before_a[n], after_a[n]) for n in after_a),
            "critic_kept": all(torch.equal(before_c[n], after_c[n]) for n in after_c),
        }

    out["no_align_actor_inf"] = overflow_round(without, without.actor.module.lm_head)
    with_ptx.config = replace(with_ptx.config, align_overflow=True)
    out["align_actor_inf"] = overflow_round(with_ptx, with_ptx.actor.module.lm_head)
    out["align_critic_inf"] = overflow_round(with_ptx, with_ptx.critic.module.v_head)
    return out


def empty_answers_checks() -> dict[str, Any]:
    """PPO at ZeRO-3 on 2 ranks where every answer of rank 1 is empty (every token ends an
    answer there): the ranks decide together, so neither runs the experience forwards (ZeRO-3
    collectives) alone. No experience yet: both skip the step; later: both reuse their
    previous batch."""
    import slipstream
    from slipstream.distributed import comm
    from slipstream.rlhf import PPOConfig, PPOTrainer, RewardModel, prompt_batch

    rank = comm.get_rank()
    actor, *_ = slipstream.initialize(model=tiny_llama(), config=config(3, 1e-3, True, 4))
    critic, *_ = slipstream.initialize(
        model=RewardModel(tiny_llama(1)), config=config(3, 1e-3, False, 4)
    )
    ppo = PPOTrainer(actor, critic, tiny_llama(), RewardModel(tiny_llama(1)),
                     PPOConfig(max_new_tokens=6))  # fmt: skip
    normal = list(ppo.eos_token_ids)
    prompts = prompt_batch(CharTokenizer(), records(4, seed=90 + rank), 8)

    def step(empty_on_rank1: bool) -> Any:
        ppo.eos_token_ids = list(range(VOCAB)) if empty_on_rank1 and rank == 1 else normal
        return ppo.step(prompts.input_ids, prompts.attention_mask)

    first = step(True)
    second = step(False)
    third = step(True)
    assert ppo._previous is not None
    return {
        "first": first,
        "second_trained": second is not None,
        "third_trained": third is not None,
        "reused": ppo._previous.reused,
    }


def saved_state(directory: Any) -> dict[str, torch.Tensor]:
    """The tensors of a model ``slipstream chat`` saved (a reward model's value head as
    ``v_head.weight``)."""
    from pathlib import Path

    from slipstream.models.files import load_gpt_state

    state = dict(load_gpt_state(directory))
    v_head = Path(directory) / "v_head.pt"
    if v_head.is_file():
        state["v_head.weight"] = torch.load(v_head, weights_only=True)["weight"]
    return state
