"""DeepSpeed-Chat's three steps on a task a program can check: sort four digits.

A prompt is four digits and ':' ("3141:"); the right answer is the digits sorted ("1134").
The preference records pair the sorted answer (chosen) with another order of the same digits
(rejected). slipstream's reference GPT with a character tokenizer goes through:

1. SFT (``sft_step``) on step 1's 20% share, kept short so that the model sorts only
   sometimes;
2. a reward model (``RewardModel`` + ``reward_step``, started from the SFT model) on step
   2's 40% share;
3. PPO (``PPOTrainer``: hybrid-engine generation, KL-shaped rewards, GAE, clipped actor and
   critic steps) on step 3's prompts, the critic starting from the reward model.

Success is checked by a program (the answer equals the sorted digits) on held-out prompts,
one sampled answer each, before and after PPO, with the mean per-token KL to the SFT model.

    python examples/rlhf_ppo.py                      # under 1 CPU minute
    slipstream run --nproc 2 examples/rlhf_ppo.py    # each rank its own prompts
"""

from __future__ import annotations

import argparse
import random
import time

import torch

import slipstream
from slipstream.models.gpt import GPT, GPTConfig
from slipstream.rlhf import (
    PPOConfig,
    PPOTrainer,
    PreferenceRecord,
    RewardModel,
    completion_mask,
    pair_batch,
    prompt_batch,
    reward_step,
    sequence_scores,
    sft_batch,
    sft_step,
    split_for_step,
)
from slipstream.rlhf.e2e import CharTokenizer
from slipstream.rlhf.policy import answer_logprobs

TOK = CharTokenizer("0123456789:")
DIGITS = 4
PROMPT_LEN, ANSWER_LEN = DIGITS + 1, DIGITS + 1  # the answer and its EOS


def make_records(n: int, seed: int) -> list[PreferenceRecord]:
    """Prompts with the sorted answer as chosen and, as rejected, in turn: another order of
    the same digits, the sorted digits with one changed, one dropped or one added (so that
    the reward model learns every part of the rule, not just "ascending": trained on the
    first kind only, PPO found longer or made-up ascending answers that it scored higher)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        digits = [rng.randrange(10) for _ in range(DIGITS)]
        while len(set(digits)) == 1:  # one order only: no "other order" to reject
            digits = [rng.randrange(10) for _ in range(DIGITS)]
        chosen = sorted(digits)
        if i % 4 == 0:
            rejected = digits[:]
            while rejected == chosen:
                rng.shuffle(rejected)
        elif i % 4 == 1:
            rejected = chosen[:]
            k = rng.randrange(DIGITS)
            rejected[k] = rng.choice([d for d in range(10) if d != chosen[k]])
            rejected.sort()
        elif i % 4 == 2:
            rejected = chosen[:]
            del rejected[rng.randrange(DIGITS)]
        else:
            rejected = sorted([*chosen, rng.randrange(10)])
        join = lambda ds: "".join(map(str, ds))  # noqa: E731
        out.append(PreferenceRecord(join(digits) + ":", join(chosen), join(rejected)))
    return out


def is_sorted_answer(prompt: str, answer: str) -> bool:
    """The rule: the answer is the prompt's digits in ascending order."""
    return answer == "".join(sorted(prompt.rstrip(":")))


def config(lr: float, batch: int, hybrid: bool = False) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": batch,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 2},
        "gradient_clipping": 1.0,
    }
    if hybrid:
        cfg["hybrid_engine"] = {"enabled": True, "max_out_tokens": PROMPT_LEN + ANSWER_LEN}
    return cfg


def new_gpt(seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig.preset("tiny", vocab_size=TOK.vocab_size, max_seq_len=16))


def rank_rows(data: list, step: int, n: int) -> list:
    """This rank's ``n`` records of optimizer step ``step`` (cycling through ``data``)."""
    rank, world = slipstream.comm.get_rank(), slipstream.comm.get_world_size()
    start = (step * world + rank) * n
    return [data[(start + i) % len(data)] for i in range(n)]


def evaluate(actor, reference, held_out: list[PreferenceRecord]) -> tuple[float, float]:
    """Share of held-out prompts whose sampled answer is right, and the mean per-token KL
    (``logp - logp_ref`` on those answers) to the reference."""
    prompts = prompt_batch(TOK, held_out, PROMPT_LEN)
    actor.eval()
    seq = actor.generate(
        prompts.input_ids, attention_mask=prompts.attention_mask, max_new_tokens=ANSWER_LEN,
        do_sample=True, seed=4321 + slipstream.comm.get_rank(), pad_token_id=0, eos_token_id=[1],
    )  # fmt: skip
    actor.train()
    answers = seq[:, PROMPT_LEN:]
    live = completion_mask(answers, [1])
    texts = [TOK.decode(row[m.bool()].tolist()) for row, m in zip(answers, live)]
    success = sum(is_sorted_answer(r.prompt, t) for r, t in zip(held_out, texts)) / len(texts)
    with torch.no_grad():
        mask = torch.cat([prompts.attention_mask, live], 1)
        n = answers.shape[1]
        logp, ref = (answer_logprobs(m, seq, mask, n)[1] for m in (actor.module, reference))
    kl = float(((logp - ref) * live).sum() / live.sum())
    return success, kl


def run(sft_steps: int = 200, rm_steps: int = 800, ppo_steps: int = 150, batch: int = 16) -> dict:
    slipstream.init_distributed()
    rank = slipstream.comm.get_rank()
    data = make_records(4000, seed=0)
    held_out = make_records(256, seed=10_000 + rank)
    timings = {}

    started = time.perf_counter()
    actor, *_ = slipstream.initialize(model=new_gpt(0), config=config(3e-3, batch))
    share = split_for_step(data, 1)
    for step in range(sft_steps):
        sft_step(actor, sft_batch(TOK, rank_rows(share, step, batch), PROMPT_LEN + ANSWER_LEN))
    sft_state = {k: v.detach().clone() for k, v in actor.module.state_dict().items()}
    timings["sft_s"] = time.perf_counter() - started

    started = time.perf_counter()
    # The reward model starts from the SFT model (DeepSpeed-Chat starts it from a pretrained
    # LM; here the SFT model is the only one that has seen digits).
    rm_start = new_gpt(0)
    rm_start.load_state_dict(sft_state)
    rm, *_ = slipstream.initialize(model=RewardModel(rm_start), config=config(1e-3, batch))
    share = split_for_step(data, 2)
    for step in range(rm_steps):
        out = reward_step(rm, pair_batch(TOK, rank_rows(share, step, batch), 10), 0)
    rm_state = {k: v.detach().clone() for k, v in rm.module.state_dict().items()}
    with torch.no_grad():
        test = pair_batch(TOK, held_out, 10)
        chosen = sequence_scores(rm.module, test.chosen_ids, test.chosen_mask)
        rejected = sequence_scores(rm.module, test.rejected_ids, test.rejected_mask)
        rm_accuracy = float((chosen > rejected).float().mean())
    timings["rm_s"] = time.perf_counter() - started

    def from_state(model: torch.nn.Module, state: dict) -> torch.nn.Module:
        model.load_state_dict(state)
        return model

    reference = from_state(new_gpt(0), sft_state)
    ppo_actor, *_ = slipstream.initialize(
        model=from_state(new_gpt(0), sft_state), config=config(2e-4, batch, hybrid=True)
    )
    critic, *_ = slipstream.initialize(
        model=from_state(RewardModel(new_gpt(1)), rm_state), config=config(1e-3, batch)
    )
    reward_model = from_state(RewardModel(new_gpt(1)), rm_state)
    trainer = PPOTrainer(
        ppo_actor, critic, reference, reward_model, PPOConfig(max_new_tokens=ANSWER_LEN),
        pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    before, _ = evaluate(ppo_actor, reference, held_out)
    started = time.perf_counter()
    share = split_for_step(data, 3)
    rewards = []
    for step in range(ppo_steps):
        prompts = prompt_batch(TOK, rank_rows(share, step, batch), PROMPT_LEN)
        m = trainer.step(prompts.input_ids, prompts.attention_mask)
        if m is not None:
            rewards.append(m.reward_mean)
    timings["ppo_s"] = time.perf_counter() - started
    after, kl = evaluate(ppo_actor, reference, held_out)
    first, last = rewards[:10], rewards[-10:]
    return {
        "rm_last_loss": float(out.loss),
        "rm_accuracy": rm_accuracy,
        "before": before,
        "after": after,
        "kl": kl,
        "reward_first": sum(first) / len(first),
        "reward_last": sum(last) / len(last),
        **timings,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=0)  # passed by `slipstream run`
    parser.add_argument("--sft-steps", type=int, default=200)
    parser.add_argument("--rm-steps", type=int, default=800)
    parser.add_argument("--ppo-steps", type=int, default=150)
    parser.add_argument("--batch", type=int, default=16, help="records per step and rank")
    args = parser.parse_args()
    torch.set_num_threads(1)  # a tiny model: more threads only wait for each other
    r = run(args.sft_steps, args.rm_steps, args.ppo_steps, args.batch)
    if slipstream.comm.get_rank() == 0:
        print(
            f"reward model: held-out pair accuracy {r['rm_accuracy']:.3f}\n"
            f"held-out success rate (sorted answer): before PPO {r['before']:.3f}, after "
            f"{r['after']:.3f}; KL to the SFT model {r['kl']:.4f} nats/token\n"
            f"PPO reward mean: first 10 steps {r['reward_first']:.3f}, last 10 "
            f"{r['reward_last']:.3f}\n"
            f"time: SFT {r['sft_s']:.1f}s, reward model {r['rm_s']:.1f}s, PPO {r['ppo_s']:.1f}s"
        )


if __name__ == "__main__":
    main()
