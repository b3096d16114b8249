"""GRPO with a rule-based reward: a tiny LLaMA learns to put a keyword token in its answers.

The reward is a program, not a model: 1 when the answer contains token KEYWORD, else 0. The
actor is trained through slipstream's hybrid engine (ZeRO-3, generation with parameters
gathered once per call); the success rate is measured on held-out prompts before and after,
with the KL to the frozen starting model.

    python examples/rlhf_grpo.py                      # one process, ~1 minute on 2 cores
    slipstream run --nproc 2 examples/rlhf_grpo.py    # ZeRO-3 over 2 ranks
"""

from __future__ import annotations

import argparse
import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import slipstream
from slipstream.rlhf import GRPOConfig, GRPOTrainer, k3_kl
from slipstream.rlhf.policy import answer_logprobs

PAD, BOS, EOS, VOCAB, KEYWORD = 0, 1, 2, 32, 7


def keyword_reward(prompts: list[list[int]], completions: list[list[int]]) -> list[float]:
    """1.0 when the answer contains KEYWORD (a rule a program checks), else 0.0."""
    return [float(KEYWORD in answer) for answer in completions]


def make_prompts(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` prompts of 3-6 random tokens (never the keyword), left-padded."""
    g = torch.Generator().manual_seed(seed)
    ids, mask = torch.full((n, 6), PAD), torch.zeros(n, 6, dtype=torch.long)
    for i in range(n):
        length = int(torch.randint(3, 7, (1,), generator=g))
        tokens = torch.randint(EOS + 1, VOCAB - 1, (length,), generator=g)
        ids[i, -length:] = tokens + (tokens >= KEYWORD).long()  # skip the keyword
        mask[i, -length:] = 1
    return ids, mask


def evaluate(engine, reference, ids, mask, max_new_tokens: int) -> tuple[float, float]:
    """Success rate of one sampled answer per held-out prompt, and the mean per-token KL
    (k3) of the policy to the reference on those answers."""
    engine.eval()
    seqs = engine.generate(
        ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=True, seed=1234
    )
    answers = seqs[:, ids.shape[1] :]
    live = slipstream.rlhf.completion_mask(answers, [EOS])
    texts = [row[m.bool()].tolist() for row, m in zip(answers, live)]
    success = sum(keyword_reward([], texts)) / len(texts)
    full = torch.cat([mask, live], 1)
    with torch.no_grad():
        logp, ref = (
            answer_logprobs(m, seqs, full, answers.shape[1])[1] for m in (engine, reference)
        )
    kl = float((k3_kl(logp, ref) * live).sum() / live.sum())
    engine.train()
    return success, kl


def run(
    steps: int = 25,
    prompts: int = 8,
    group: int = 4,
    max_new_tokens: int = 6,
    lr: float = 3e-3,
    kl_coef: float = 0.1,
    log: str | None = None,
) -> dict[str, float]:
    """Train ``steps`` GRPO steps; return the held-out success before/after and the KL.

    Every rank passes its own ``prompts`` prompts per step (tests call this inside a world).
    """
    slipstream.init_distributed()
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
            pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS,
        )
    )  # fmt: skip
    reference = copy.deepcopy(model)
    config = {
        "train_micro_batch_size_per_gpu": prompts * group,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "gradient_clipping": 1.0,
        "hybrid_engine": {"enabled": True, "max_out_tokens": 32},
    }
    engine, *_ = slipstream.initialize(model=model, config=config)
    trainer = GRPOTrainer(
        engine,
        keyword_reward,
        GRPOConfig(group_size=group, max_new_tokens=max_new_tokens, kl_coef=kl_coef),
        reference=reference,
        log_path=log,
    )
    rank = slipstream.comm.get_rank()
    held_out = make_prompts(64, seed=10_000 + rank)
    before, _ = evaluate(engine, reference, *held_out, max_new_tokens)
    for step in range(steps):
        trainer.step(*make_prompts(prompts, seed=step * 97 + rank))
    after, kl = evaluate(engine, reference, *held_out, max_new_tokens)
    stats = engine.hybrid_engine.stats
    return {
        "before": before,
        "after": after,
        "kl": kl,
        "generate_s": stats.generate_seconds,
        "calls": stats.calls,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=0)  # passed by `slipstream run`
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step and rank")
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=6)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--kl-coef", type=float, default=0.1)
    parser.add_argument("--log", default=None, help="JSON-lines metrics file")
    args = parser.parse_args()
    torch.set_num_threads(1)  # a tiny model: more threads only wait for each other
    r = run(
        args.steps, args.prompts, args.group, args.max_new_tokens, args.lr, args.kl_coef, args.log
    )
    if slipstream.comm.get_rank() == 0:
        print(
            f"held-out success rate: before {r['before']:.3f} after {r['after']:.3f}; "
            f"KL to reference {r['kl']:.4f} nats/token; generation {r['generate_s']:.1f}s "
            f"over {r['calls']:.0f} calls"
        )


if __name__ == "__main__":
    main()
