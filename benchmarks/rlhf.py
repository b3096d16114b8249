"""RLHF benchmarks (issue 23): hybrid-engine generation, a GRPO step against TRL, and the
GRPO step-time breakdown, in one run.

Usage::

    python benchmarks/rlhf.py                        # (a), (b), (c) with the defaults below
    python benchmarks/rlhf.py --parts a,c --repeats 7 --new-tokens 64
    python benchmarks/rlhf.py --parts b --steps 12 --json out.json

All three use one tiny Hugging Face LLaMA built from a config (random weights, seeded; 4
layers, hidden 256, vocab 1024: 3.5M parameters) whose special tokens can never be sampled
(see :func:`build_model`), so every answer is exactly as long as asked and every variant does
the same work.

(a) **Generation under ZeRO-3, world** ``--world`` **(gloo).** One engine (ZeRO-3, every
    parameter partitioned, ``hybrid_engine`` on), three ways to generate the same greedy
    answers to the same prompts (each rank its own):

    * ``hybrid``: ``engine.generate``, parameters gathered once per call (``pin_parameters``
      true), slipstream's KV-cache decode loop;
    * ``per-layer``: the same decode loop with ``pin_parameters`` false: ZeRO-3's hooks
      gather every layer for every token (DeepSpeed's unpinned mode);
    * ``hf-zero3``: Hugging Face's own ``generate`` on the ZeRO-3 module with
      ``synced_gpus=True``, what DeepSpeed-Chat runs without the hybrid engine (the hooks
      gather every layer for every token, HF's decode loop).

    Every output must equal the unsharded model's greedy ``generate`` token for token (the
    table says so). Calls are timed round-robin (the order reversed every other repeat), a
    barrier before each; a call's time is its slowest rank's.

(b) **One GRPO step, slipstream vs TRL, one process.** slipstream's ``GRPOTrainer`` (ZeRO
    stage 0, hybrid engine on) and TRL's ``GRPOTrainer`` on the same starting weights,
    the same equal-length prompts, group size, answer length, KL weight (TRL's ``beta``), clip,
    learning rate, gradient clipping and the same rule-based reward (the answer contains the
    keyword word; slipstream scores token ids, TRL decoded text of a tiny word-level tokenizer
    built offline). TRL: ``loss_type="grpo"``, ``scale_rewards="group"`` (slipstream's
    estimator), ``gradient_checkpointing`` off and fp32 (TRL defaults them on; slipstream uses
    neither). The steps interleave: a TRL callback runs one slipstream step after each TRL
    step. TRL's step is the time from its ``on_step_begin`` to its ``on_step_end`` callback
    (generation, reference and policy forwards, backward, clipping, optimizer step).
    slipstream runs twice per TRL step (order alternating): its rollouts on the
    continuous-batching engine (paged KV cache, the group's copies sharing prompt blocks; the
    default) and on the static decode loop (``hybrid_engine.rollouts = "static"``).
    ``--eos-weight 0.8`` makes answers ragged (each ends at every token with the same small
    probability, up to ``--grpo-new-tokens``); issue 37's goal is measured with
    ``--parts b --group 8 --eos-weight 0.8``.

(c) **slipstream's step-time breakdown** from ``GRPOMetrics`` (generation / scoring /
    training) and the hybrid engine's ``stats`` (gather, part of generation): the ZeRO-3 steps
    of world ``--world`` (run in (a)'s world after its timings) and the stage-0 steps of (b).

Figures are medians over the timed repeats; ratios are taken within one run. The machine
this was written on is a shared 2-core VM: compare ratios, not absolute times.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist

from benchmarks._harness import BenchConfig, spawn_world

__all__ = ["Options", "build_model", "main", "parse_args"]

PAD, BOS, EOS, KEYWORD = 0, 1, 2, 7
"""Special token ids, and the token the reward looks for (``w7`` as text)."""
_SPECIALS = (PAD, BOS, EOS)


@dataclass(frozen=True)
class Options:
    """Everything a rank needs (picklable, so it crosses the spawn)."""

    world: int = 2
    hidden: int = 256
    layers: int = 4
    vocab: int = 1024
    batch: int = 4
    """(a): prompts per rank per generate call."""
    prompt_len: int = 16
    new_tokens: int = 32
    """(a): answer length."""
    repeats: int = 5
    """(a): timed calls per variant (after one untimed warm-up call each)."""
    prompts: int = 2
    """(b), (c): prompts per GRPO step (per rank)."""
    group: int = 4
    grpo_new_tokens: int = 32
    steps: int = 8
    """(b), (c): timed GRPO steps (after ``warmup``)."""
    warmup: int = 2
    kl_coef: float = 0.04
    eos_weight: float = 0.0
    """(b): > 0 makes answers ragged: EOS's LM-head weight on the constant coordinate (see
    :func:`build_model`; 0.8: 16 answers of up to 32 tokens sampled without top-k, as both
    trainers sample, averaged 21 tokens, from 3 to 32; the report prints both trainers' mean
    lengths); 0: EOS never sampled."""
    lr: float = 1e-5
    threads: int = 1
    """(b): torch threads of the one process (both trainers; (a) uses cores // world)."""
    seed: int = 0
    timeout_s: float = 900.0

    def __post_init__(self) -> None:
        positive = ("world", "hidden", "layers", "batch", "prompt_len", "new_tokens", "repeats")
        for name in (*positive, "prompts", "grpo_new_tokens", "steps", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)} must be >= 1")
        if self.group < 2:
            raise ValueError(f"--group={self.group}: GRPO needs at least 2 answers per prompt")
        if self.eos_weight < 0:
            raise ValueError(f"--eos-weight={self.eos_weight} must be >= 0 (0: EOS never sampled)")
        if self.warmup < 0:
            raise ValueError(f"--warmup={self.warmup} must be >= 0")
        if self.vocab <= KEYWORD + 1:
            raise ValueError(f"--vocab={self.vocab} must be > {KEYWORD + 1} (the keyword id)")
        if self.hidden % 16:
            raise ValueError(
                f"--hidden={self.hidden} must be a multiple of 16 (8 heads of an even size, "
                "for the rotary embedding)"
            )

    @property
    def max_len(self) -> int:
        return self.prompt_len + max(self.new_tokens, self.grpo_new_tokens)


# --------------------------------------------------------------------------- model and data


def build_model(opts: Options, ragged: bool = False) -> Any:
    """A seeded random LLaMA whose special tokens (PAD, BOS, EOS) are never sampled.

    Residual dimension 0 is held at 1: the embeddings' column 0 is 1 and no attention or MLP
    output writes to it (row 0 of ``o_proj`` and ``down_proj`` is 0). After the final RMSNorm
    that coordinate is therefore large and positive, and the LM-head rows of the special
    tokens, ``-10`` there and 0 elsewhere, give them logits far below every other token's. So
    no answer ends early and every framework generates exactly the tokens it is asked for.
    With ``ragged`` and ``opts.eos_weight`` > 0, EOS's row is ``eos_weight`` there instead:
    a logit a few units above the others', so an answer ends at each token with a fixed
    probability (ragged lengths, the same distribution for every framework).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(opts.seed)
    config = LlamaConfig(
        vocab_size=opts.vocab, hidden_size=opts.hidden, intermediate_size=opts.hidden * 11 // 4,
        num_hidden_layers=opts.layers, num_attention_heads=8, num_key_value_heads=4,
        max_position_embeddings=max(64, opts.max_len), pad_token_id=PAD, bos_token_id=BOS,
        eos_token_id=EOS, tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 1.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
        for token in _SPECIALS:
            model.lm_head.weight[token] = 0.0
            model.lm_head.weight[token, 0] = -10.0
        if ragged and opts.eos_weight > 0:
            model.lm_head.weight[EOS, 0] = opts.eos_weight
    model.generation_config.do_sample = False
    return model


def random_prompts(opts: Options, n: int, seed: int) -> torch.Tensor:
    """``n`` equal-length prompts of ordinary tokens (never the keyword), ``[n, prompt_len]``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(KEYWORD + 1, opts.vocab, (n, opts.prompt_len), generator=g)
    return ids


def keyword_reward(prompts: list[list[int]], completions: list[list[int]]) -> list[float]:
    """slipstream's reward: 1 when the answer's token ids contain KEYWORD."""
    return [float(KEYWORD in answer) for answer in completions]


def keyword_reward_text(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    """TRL's reward, the same rule on decoded text: 1 when the answer has the word ``w7``."""
    return [float(f"w{KEYWORD}" in answer.split()) for answer in completions]


def build_tokenizer(opts: Options) -> Any:
    """A word-level tokenizer built offline: ``<pad> <bos> <eos> w3 ... w{vocab-1}``."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, "<bos>": BOS, "<eos>": EOS}
    vocab.update({f"w{i}": i for i in range(len(_SPECIALS), opts.vocab)})
    tok = Tokenizer(WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>"
    )


def engine_config(opts: Options, stage: int, batch: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": batch,
        "optimizer": {"type": "AdamW", "params": {"lr": opts.lr, "weight_decay": 0.0}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "hybrid_engine": {"enabled": True, "max_out_tokens": opts.max_len},
    }


def _slowest(seconds: float) -> float:
    """The slowest rank's time (every rank calls this)."""
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


class CpuPhases:
    """Process CPU seconds spent in named methods of one object, patched on the instance
    (a method called inside another is counted in both: report the difference)."""

    def __init__(self, obj: Any, methods: dict[str, str]) -> None:
        self.seconds = dict.fromkeys(methods.values(), 0.0)
        for name, phase in methods.items():
            setattr(obj, name, self._timed(getattr(obj, name), phase))

    def _timed(self, method: Callable[..., Any], phase: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.process_time()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds[phase] += time.process_time() - start

        return timed

    def take(self) -> dict[str, float]:
        """The seconds since the last call, per phase."""
        out, self.seconds = self.seconds, dict.fromkeys(self.seconds, 0.0)
        return out


def slipstream_phases(trainer: Any) -> CpuPhases:
    """generate (rollouts), score (reward and the reference's / old policy's forwards),
    train (the updates: forward, backward, optimizer step)."""
    methods = {"generate": "generate", "score": "score", "_frozen_logprobs": "frozen"}
    return CpuPhases(trainer, {**methods, "_update": "train"})


# --------------------------------------------------------------------------- (a) and (c)


def _generation_rank(opts: Options, rank: int, device: torch.device) -> dict[str, Any]:
    """One rank of (a) then (c): time three generation paths, then GRPO steps at ZeRO-3."""
    import slipstream
    from slipstream.rlhf.hybrid import HybridEngine

    model = build_model(opts)
    reference = copy.deepcopy(model)
    prompts = random_prompts(opts, opts.batch, seed=1000 + rank)
    mask = torch.ones_like(prompts)
    gen_kwargs = {
        "attention_mask": mask,
        "max_new_tokens": opts.new_tokens,
        "do_sample": False,
        "pad_token_id": PAD,
        "eos_token_id": EOS,
    }
    with torch.no_grad():
        expected = model.generate(prompts, **gen_kwargs)  # the unsharded model, HF's loop
    _check_full_length(expected[:, prompts.shape[1] :], opts.new_tokens, f"rank {rank}")
    engine, *_ = slipstream.initialize(model=model, config=engine_config(opts, 3, opts.batch))
    module: Any = engine.module  # the HF model; its class's generate is HF's, not the hybrid's
    unpinned_cfg = engine.config.hybrid_engine.model_copy(update={"pin_parameters": False})
    variants: dict[str, Callable[..., torch.Tensor]] = {
        "hybrid": engine.generate,
        "per-layer": HybridEngine(engine, unpinned_cfg).generate,
        "hf-zero3": partial(type(module).generate, module, synced_gpus=True),
    }
    engine.eval()
    same = {}
    for name, generate in variants.items():  # the untimed warm-up call checks the tokens
        same[name] = bool(torch.equal(generate(prompts, **gen_kwargs), expected))
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(opts.repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            dist.barrier()
            start = time.perf_counter()
            variants[name](prompts, **gen_kwargs)
            times[name].append(_slowest(time.perf_counter() - start))
    engine.train()

    trainer = _grpo_trainer(opts, engine, reference)
    steps = _grpo_steps(opts, trainer, engine, rank)
    return {
        "same_tokens": same,
        "times": times,
        "new_tokens": int(expected.shape[1] - prompts.shape[1]) * opts.batch,
        "grpo": steps,
    }


def _check_full_length(answers: torch.Tensor, length: int, who: str) -> None:
    """Every answer must run to full length (build_model's guarantee); else the variants
    would not do equal work."""
    if answers.shape[1] != length or bool(torch.isin(answers, torch.tensor(_SPECIALS)).any()):
        raise RuntimeError(
            f"{who}: the unsharded model's greedy answers hold a special token or end early "
            f"(shape {tuple(answers.shape)}, {length} tokens asked); build_model's residual "
            "trick no longer holds for these options"
        )


def _grpo_trainer(opts: Options, engine: Any, reference: Any) -> Any:
    """slipstream's GRPO trainer with the run's group size, answer length and KL weight."""
    from slipstream.rlhf import GRPOConfig, GRPOTrainer

    config = GRPOConfig(  # top-k off: TRL's GRPOConfig default (top_k=0)
        group_size=opts.group, max_new_tokens=opts.grpo_new_tokens, kl_coef=opts.kl_coef, top_k=0
    )
    return GRPOTrainer(engine, keyword_reward, config, reference=reference)


def _grpo_steps(opts: Options, trainer: Any, engine: Any, rank: int) -> list[dict[str, float]]:
    """``warmup + steps`` slipstream GRPO steps; each step's metrics plus its gather time."""
    out = []
    ids = random_prompts(opts, opts.prompts, seed=2000 + rank)
    for _ in range(opts.warmup + opts.steps):
        out.append(_one_grpo_step(trainer, engine, ids))
    return out[opts.warmup :]


def _one_grpo_step(
    trainer: Any, engine: Any, ids: torch.Tensor, phases: CpuPhases | None = None
) -> dict[str, float]:
    gathered = engine.hybrid_engine.stats.gather_seconds
    start, cpu = time.perf_counter(), time.process_time()
    metrics = trainer.step(ids, torch.ones_like(ids))
    record = asdict(metrics)
    record["step_s"] = time.perf_counter() - start
    record["cpu_s"] = time.process_time() - cpu
    record["gather_s"] = engine.hybrid_engine.stats.gather_seconds - gathered
    if phases is not None:
        cpu_phases = phases.take()
        record["cpu_generate_s"] = cpu_phases["generate"]
        record["cpu_score_s"] = cpu_phases["score"] + cpu_phases["frozen"]
        record["cpu_train_s"] = cpu_phases["train"]
    return record


# --------------------------------------------------------------------------- (b)


def _grpo_vs_trl_rank(opts: Options, rank: int, device: torch.device) -> dict[str, Any]:
    """(b) in one process, in a scratch directory removed afterwards."""
    workdir = Path(tempfile.mkdtemp(prefix="slipstream-bench-rlhf-"))
    try:
        return _grpo_vs_trl(opts, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _grpo_vs_trl(opts: Options, workdir: Path) -> dict[str, Any]:
    """TRL's trainer loop, with one slipstream step after each TRL step."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer as TRLTrainer

    import slipstream

    torch.set_num_threads(opts.threads)
    model = build_model(opts, ragged=True)
    tokenizer = build_tokenizer(opts)
    model.save_pretrained(workdir / "model")  # TRL builds its reference model from a path
    tokenizer.save_pretrained(workdir / "model")
    reference = copy.deepcopy(model)
    static_model = copy.deepcopy(model)
    n_rows = opts.prompts * opts.group
    engine, *_ = slipstream.initialize(model=model, config=engine_config(opts, 0, n_rows))
    ours = _grpo_trainer(opts, engine, reference)
    ours_phases = slipstream_phases(ours)
    # The same trainer with the static decode loop (the rollouts before issue 37).
    static_engine, *_ = slipstream.initialize(
        model=static_model, config=engine_config(opts, 0, n_rows)
    )
    static_engine.hybrid_engine.rollouts = "static"
    ours_static = _grpo_trainer(opts, static_engine, reference)
    static_phases = slipstream_phases(ours_static)
    ids = random_prompts(opts, opts.prompts, seed=2000)
    texts = [" ".join(f"w{int(t)}" for t in row) for row in random_prompts(opts, 64, seed=3000)]
    total = opts.warmup + opts.steps
    args = TRLConfig(
        output_dir=str(workdir / "trl"),
        per_device_train_batch_size=n_rows,
        gradient_accumulation_steps=1,
        num_generations=opts.group,
        max_completion_length=opts.grpo_new_tokens,
        temperature=1.0,
        beta=opts.kl_coef,
        epsilon=0.2,
        loss_type="grpo",
        scale_rewards="group",
        num_iterations=1,
        learning_rate=opts.lr,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        max_steps=total,
        gradient_checkpointing=False,
        bf16=False,
        fp16=False,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=total + 1,
        disable_tqdm=True,
        seed=opts.seed,
        model_init_kwargs={"dtype": torch.float32},
    )
    ours_steps: list[dict[str, float]] = []
    static_steps: list[dict[str, float]] = []
    trl_steps: list[float] = []
    trl_cpu: list[float] = []
    trl_phases: list[dict[str, float]] = []
    trl_timer: list[CpuPhases] = []  # set once TRL's trainer exists

    class Interleave(TrainerCallback):  # type: ignore[misc]
        """Times each TRL step, then runs one slipstream step outside TRL's timing."""

        def on_step_begin(self, *a: Any, **k: Any) -> None:
            trl_timer[0].take()
            self.start, self.cpu = time.perf_counter(), time.process_time()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            trl_steps.append(time.perf_counter() - self.start)
            trl_cpu.append(time.process_time() - self.cpu)
            p = trl_timer[0].take()  # nested: generate in prepare, prepare in training_step
            trl_phases.append(
                {
                    "cpu_generate_s": p["generate"],
                    "cpu_score_s": p["prepare"] - p["generate"],
                    "cpu_train_s": trl_cpu[-1] - p["prepare"],
                    "cpu_optimizer_s": trl_cpu[-1] - p["training_step"],
                }
            )
            runs = [
                (ours_steps, ours, engine, ours_phases),
                (static_steps, ours_static, static_engine, static_phases),
            ]
            for steps, trainer, eng, phases in runs if len(trl_steps) % 2 else runs[::-1]:
                steps.append(_one_grpo_step(trainer, eng, ids, phases))

    trl = TRLTrainer(
        model=str(workdir / "model"),
        reward_funcs=keyword_reward_text,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": texts}),
        processing_class=tokenizer,
        callbacks=[Interleave()],
    )
    # TRL's phases: _generate (rollouts) inside _generate_and_score_completions (+ rewards,
    # reference forward) inside training_step (+ policy forward, loss, backward); the rest
    # of the step is gradient clipping and the optimizer.
    trl_timer.append(
        CpuPhases(
            trl,
            {
                "_generate": "generate",
                "_generate_and_score_completions": "prepare",
                "training_step": "training_step",
            },
        )
    )
    trl.train()
    lengths = [
        m["completions/mean_length"]
        for m in trl.state.log_history
        if "completions/mean_length" in m
    ]
    return {
        "trl_s": trl_steps[opts.warmup :],
        "trl_cpu_s": trl_cpu[opts.warmup :],
        "trl_phases": trl_phases[opts.warmup :],
        "grpo": ours_steps[opts.warmup :],
        "grpo_static": static_steps[opts.warmup :],
        "trl_version": _version("trl"),
        "trl_mean_length": lengths,
        "trl_kl": [m["kl"] for m in trl.state.log_history if "kl" in m],
    }


def _version(package: str) -> str:
    import importlib.metadata

    return importlib.metadata.version(package)


# --------------------------------------------------------------------------- report


def _median(values: list[float]) -> float:
    return statistics.median(values)


def report_generation(opts: Options, result: dict[str, Any]) -> list[str]:
    """(a)'s table: median seconds per call, tokens/s of the world, ratio to hybrid."""
    tokens = result["new_tokens"] * opts.world
    hybrid = _median(result["times"]["hybrid"])
    lines = [
        f"(a) generation under ZeRO-3, world {opts.world} (gloo), greedy, {opts.batch} prompts "
        f"x {opts.prompt_len} tokens per rank, {opts.new_tokens} new tokens each, "
        f"{opts.repeats} interleaved repeats",
        f"{'variant':<11} {'median s':>9} {'tokens/s':>9} {'hybrid x':>9}  same tokens  every repeat (s)",
    ]
    for name, times in result["times"].items():
        med = _median(times)
        each = " ".join(f"{t:.3f}" for t in times)
        same = "yes" if all(r["same_tokens"][name] for r in result["ranks"]) else "NO"
        lines.append(
            f"{name:<11} {med:>9.3f} {tokens / med:>9.0f} {med / hybrid:>9.2f}  {same:<11}  {each}"
        )
    return lines


def report_breakdown(title: str, steps: list[dict[str, float]]) -> list[str]:
    """(c): median seconds of each phase of one rank's (rank 0's) steps, and each phase's
    share of the summed step time (medians of parts need not add up to the median step)."""
    parts = ("generate_s", "gather_s", "score_s", "train_s")
    med = {k: _median([s[k] for s in steps]) for k in ("step_s", "tokens_per_s", *parts)}
    total = sum(s["step_s"] for s in steps)
    shares = "  ".join(
        f"{k[:-2]} {med[k]:.3f}s ({100 * sum(s[k] for s in steps) / total:.0f}%)" for k in parts
    )
    return [
        f"{title}: step {med['step_s']:.3f}s; {shares}; {med['tokens_per_s']:.0f} generated "
        f"tokens/s (medians of {len(steps)} steps; gather is part of generate, score includes "
        "the reference model's forward)"
    ]


def report_trl(opts: Options, result: dict[str, Any]) -> list[str]:
    """(b)'s table: median wall and process-CPU seconds per step, slipstream over TRL."""
    ours = [s["step_s"] for s in result["grpo"]]
    trl, trl_cpu = result["trl_s"], result["trl_cpu_s"]
    trl_len = result["trl_mean_length"]
    ragged = f"ragged answers (eos weight {opts.eos_weight})" if opts.eos_weight > 0 else ""
    lines = [
        f"(b) one GRPO step, one process, {opts.threads} thread(s): {opts.prompts} prompts x "
        f"{opts.group} answers x up to {opts.grpo_new_tokens} tokens {ragged}, kl "
        f"{opts.kl_coef}, TRL {result['trl_version']}, {len(ours)} interleaved steps after "
        f"{opts.warmup} warm-up",
        f"{'trainer':<18} {'median s':>9} {'cpu s':>7} {'vs TRL':>7} {'cpu vs TRL':>10}  every step (s)",
    ]
    for name, key in (("slipstream paged", "grpo"), ("slipstream static", "grpo_static")):
        wall_s = [s["step_s"] for s in result.get(key, [])]
        cpu_s = [s["cpu_s"] for s in result.get(key, [])]
        if not wall_s:
            continue
        wall, cpu = _median(wall_s) / _median(trl), _median(cpu_s) / _median(trl_cpu)
        lines.append(
            f"{name:<18} {_median(wall_s):>9.3f} {_median(cpu_s):>7.3f} {wall:>7.2f} "
            f"{cpu:>10.2f}  " + " ".join(f"{t:.3f}" for t in wall_s)
        )
    phase_lines = [
        "process CPU per phase, medians (s): generate / score (reward, reference and "
        "old-policy forwards) / train (forward, backward, clipping, optimizer)"
    ]
    keys = ("cpu_generate_s", "cpu_score_s", "cpu_train_s")
    for name, steps in (
        ("slipstream paged", result.get("grpo", [])),
        ("slipstream static", result.get("grpo_static", [])),
        ("trl", result.get("trl_phases", [])),
    ):
        if steps and all(k in steps[0] for k in keys):
            parts = " / ".join(f"{_median([s[k] for s in steps]):.3f}" for k in keys)
            extra = ""
            if "cpu_optimizer_s" in steps[0]:
                opt_s = _median([s["cpu_optimizer_s"] for s in steps])
                extra = f" (of train: clipping + optimizer {opt_s:.3f})"
            phase_lines.append(f"  {name:<18} {parts}{extra}")
    return [
        *lines,
        f"{'trl':<18} {_median(trl):>9.3f} {_median(trl_cpu):>7.3f} {1.0:>7.2f} {1.0:>10.2f}  "
        + " ".join(f"{t:.3f}" for t in trl),
        "per-step wall ratios slipstream/TRL: "
        + " ".join(f"{a / b:.2f}" for a, b in zip(ours, trl))
        + f"; answer length slipstream {_median([s['response_length'] for s in result['grpo']]):.1f}"
        + (f", TRL {_median(trl_len):.1f}" if trl_len else "")
        + (f"; TRL logged KL {result['trl_kl'][-1]:.2e}" if result.get("trl_kl") else ""),
        *(phase_lines if len(phase_lines) > 1 else []),
    ]


def run_generation(opts: Options) -> dict[str, Any]:
    cfg = BenchConfig(world=opts.world, timeout_s=opts.timeout_s, seed=opts.seed)
    outcome = spawn_world("rlhf-generate", cfg, partial(_generation_rank, opts))
    if not outcome.ok:
        raise RuntimeError(f"(a)/(c) world failed: {outcome.error}\n{outcome.detail}")
    first = outcome.records[0]
    return {"ranks": outcome.records, "times": first["times"], "new_tokens": first["new_tokens"]}


def run_trl(opts: Options) -> dict[str, Any]:
    cfg = BenchConfig(world=1, timeout_s=opts.timeout_s, seed=opts.seed)
    outcome = spawn_world("rlhf-trl", cfg, partial(_grpo_vs_trl_rank, opts))
    if not outcome.ok:
        raise RuntimeError(f"(b) failed: {outcome.error}\n{outcome.detail}")
    return outcome.records[0]


def parse_args(argv: list[str] | None = None) -> tuple[Options, set[str], str | None]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="a,b,c", help="comma-separated subset of a,b,c")
    for field, value in asdict(Options()).items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument("--json", default=None, help="write every measurement here")
    ns = parser.parse_args(argv)
    parts = {p.strip() for p in ns.parts.split(",") if p.strip()}
    if not parts or parts - {"a", "b", "c"}:
        parser.error(f"--parts={ns.parts!r}: give a comma-separated subset of a,b,c")
    values = {k: v for k, v in vars(ns).items() if k not in ("parts", "json")}
    try:
        opts = Options(**values)
    except ValueError as err:
        parser.error(str(err))
    return opts, parts, ns.json


def main(argv: list[str] | None = None) -> int:
    opts, parts, json_path = parse_args(argv)
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} CPUs")
    lines: list[str] = []
    breakdown: list[str] = []
    record: dict[str, Any] = {"options": asdict(opts), "load_before": load}
    if parts & {"a", "c"}:
        gen = run_generation(opts)
        record["generation"] = gen
        if "a" in parts:
            lines += report_generation(opts, gen)
        if "c" in parts:
            breakdown += report_breakdown(
                f"(c) slipstream GRPO, ZeRO-3, world {opts.world}, rank 0", gen["ranks"][0]["grpo"]
            )
    if "b" in parts:
        trl = run_trl(opts)
        record["trl"] = trl
        lines += report_trl(opts, trl)
        if "c" in parts:
            breakdown += report_breakdown("(c) slipstream GRPO, ZeRO-0, one process", trl["grpo"])
            breakdown += report_breakdown("(c) the same, static rollouts", trl["grpo_static"])
    record["load_after"] = os.getloadavg()
    print("\n".join(lines + breakdown))
    print(f"load average after {record['load_after'][0]:.2f}")
    if json_path:
        Path(json_path).write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
