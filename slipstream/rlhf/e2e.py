"""``slipstream chat``: DeepSpeed-Chat's three steps end to end (its ``e2e_rlhf.py``).

Step 1 (SFT) trains the actor on its share of the preference records, step 2 a reward model
on its share, step 3 PPO (:class:`~slipstream.rlhf.ppo.PPOTrainer`) with the step-1 actor,
its frozen copy as the reference, the step-2 model as the critic and as the frozen reward
model. Each step trains ``epochs`` passes over its share and saves its model under
``OUTPUT/step1_sft``, ``OUTPUT/step2_reward``, ``OUTPUT/step3_rlhf/actor`` (and ``critic``,
``actor_ema``); ``step="all"`` feeds each step's output to the next.

Models are local Hugging Face directories (``AutoModelForCausalLM`` and ``AutoTokenizer``,
offline) or slipstream's reference GPT, named ``gpt:PRESET`` (``tiny``, ``small``, ``25m``)
with a character tokenizer built from the data, and saved as ``slipstream_gpt.json`` +
``model.pt`` + ``tokenizer.json``. A reward-model directory (step 2's output) also holds
``v_head.pt``. Every rank runs this (``slipstream run --nproc N -m slipstream.cli.main chat
...``); each takes its own slice of every batch, rank 0 writes the files.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from slipstream._logging import log_rank0
from slipstream.config import ConfigError
from slipstream.distributed import comm
from slipstream.rlhf.data import (
    PreferenceRecord,
    apply_chat_template,
    check_same_tokenizer,
    load_preference_records,
    pair_batch,
    prompt_batch,
    sft_batch,
    split_for_step,
    text_batch,
)
from slipstream.rlhf.lora import LoRAPolicy, apply_lora_policy_
from slipstream.rlhf.model_files import (
    CharTokenizer,
    load_lm,
    load_reward_model,
    load_tokenizer,
    model_kind,
    require_trained_reward_model,
    save_model,
)
from slipstream.rlhf.offload import offload_frozen_
from slipstream.rlhf.ppo import PPOConfig, PPOMetrics, PPOTrainer
from slipstream.rlhf.reward import RewardModel, reward_step
from slipstream.rlhf.sft import sft_step as _sft_step
from slipstream.rlhf.step_log import log_step_metrics
from slipstream.runtime.engine import Engine
from slipstream.runtime.initialize import initialize

__all__ = [
    "CharTokenizer",
    "ChatOptions",
    "load_lm",
    "load_reward_model",
    "run_chat",
    "save_model",
]

STEP_DIRS = {1: "step1_sft", 2: "step2_reward", 3: "step3_rlhf"}


@dataclass
class ChatOptions:
    """What ``slipstream chat`` takes (defaults: DeepSpeed-Chat's where it has one)."""

    actor: str
    data: str
    output: str
    reward: str | None = None
    step: str = "all"
    """``"1"``, ``"2"``, ``"3"`` or ``"all"``."""
    data_split: str = "2,4,4"
    seed: int = 1234
    epochs: int = 1
    step_epochs: dict[int, int] = field(default_factory=dict)
    """Per-step overrides of ``epochs``."""
    batch_size: int = 4
    """Records per rank per optimizer step (micro-batch x gradient accumulation)."""
    max_seq_len: int = 512
    max_prompt_len: int = 256
    max_answer_len: int = 256
    sft_lr: float = 9.65e-6
    reward_lr: float = 5e-5
    actor_lr: float = 9.65e-6
    critic_lr: float = 5e-6
    actor_zero_stage: int = 0
    critic_zero_stage: int = 0
    actor_config: str | None = None
    """A DeepSpeed JSON config for the actor (steps 1 and 3); its keys win over the flags'."""
    critic_config: str | None = None
    """The same for the reward model and critic (steps 2 and 3)."""
    kl_coef: float = 0.1
    temperature: float = 1.0
    unsupervised_data: str | None = None
    """PTX text (``.txt``: one text per line; ``.json``/``.jsonl``: records with ``text``)."""
    ptx_coef: float = 27.8
    align_overflow: bool = False
    enable_ema: bool = False
    drop_long_prompts: bool = False
    actor_lora_dim: int = 0
    """Step 3: rank of the actor's LoRA adapters (DeepSpeed-Chat's ``--actor_lora_dim``; 0 off)."""
    actor_lora_module_name: str = "layers."
    """Substring of the actor's linear layers to convert (``--actor_lora_module_name``)."""
    critic_lora_dim: int = 0
    """Step 3: rank of the critic's adapters (``--critic_lora_dim``; 0 off)."""
    critic_lora_module_name: str = "layers."
    only_optimize_lora: bool = False
    """Train only the adapters (and the critic's ``v_head``) of the models with LoRA."""
    offload_reference_model: bool = False
    """Keep the frozen reference in host memory, streamed per forward (``offload_frozen_``)."""
    offload_reward_model: bool = False
    """The same for the frozen reward model (DeepSpeed-Chat ties it to ``--offload``)."""

    def epochs_of(self, step: int) -> int:
        return self.step_epochs.get(step, self.epochs)


# ---------------------------------------------------------------------------- data


def _read_texts(path: str) -> list[str]:
    """PTX text: a ``.txt`` file (one text per non-empty line) or JSON/JSONL records with a
    ``text`` field."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--unsupervised-data {path} does not exist")
    raw = p.read_text()
    if p.suffix == ".txt":
        return [line for line in raw.splitlines() if line.strip()]
    rows = (
        [json.loads(line) for line in raw.splitlines() if line.strip()]
        if p.suffix == ".jsonl"
        else json.loads(raw)
    )
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise ConfigError(
                f"{path}: record {i} has no 'text' string; PTX data is a .txt file (one text "
                'per line) or JSON records {"text": ...}'
            )
    return [row["text"] for row in rows]


def _rank_batches(
    items: Sequence[Any], per_rank: int, epoch: int, seed: int, what: str
) -> Iterator[list[Any]]:
    """One epoch of ``items``: shuffled with ``seed + epoch``; each optimizer step gives
    every rank its own ``per_rank`` items (an incomplete last step is dropped, so all ranks
    take the same number of steps)."""
    world, rank = comm.get_world_size(), comm.get_rank()
    steps = len(items) // (per_rank * world)
    if steps == 0:
        raise ConfigError(
            f"{what} has {len(items)} records, fewer than --batch-size {per_rank} x {world} "
            "ranks for one step; give more data, a smaller --batch-size or a different "
            "--data-split"
        )
    order = torch.randperm(len(items), generator=torch.Generator().manual_seed(seed + epoch))
    for s in range(steps):
        lo = (s * world + rank) * per_rank
        yield [items[int(i)] for i in order[lo : lo + per_rank]]


def _engine_config(
    user: str | None, batch: int, lr: float, stage: int, hybrid_tokens: int | None
) -> dict[str, Any]:
    """The flags' config, updated by the user's JSON (whose keys win); the hybrid engine is
    switched on for the PPO actor unless the JSON sets it."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": batch,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 1.0,
    }
    if user is not None:
        path = Path(user)
        if not path.is_file():
            raise ConfigError(f"DeepSpeed config {user} does not exist")
        try:
            loaded = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"DeepSpeed config {user}: not valid JSON ({e})") from e
        if "train_batch_size" in loaded or "train_micro_batch_size_per_gpu" in loaded:
            config.pop("train_micro_batch_size_per_gpu")
        config.update(loaded)
    if hybrid_tokens is not None:
        block = config.setdefault("hybrid_engine", {})
        block.setdefault("enabled", True)
        block.setdefault("max_out_tokens", hybrid_tokens)
    return config


def _per_rank(engine: Engine) -> int:
    return engine.train_micro_batch_size_per_gpu() * engine.gradient_accumulation_steps()


class _MetricsFile:
    """A step's JSON-lines file, emptied at the start, and the engine's monitors (None: the
    trainer writes them itself); ``slipstream plot`` reads both."""

    def __init__(self, path: Path, engine: Engine | None, name: str) -> None:
        self.path, self.engine, self.name = path, engine, name
        if comm.get_rank() == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("")

    def write(self, row: dict[str, Any]) -> None:
        log_step_metrics(self.engine, self.name, row, self.path)


# ---------------------------------------------------------------------------- the steps


@dataclass
class _Run:
    opts: ChatOptions
    records: list[PreferenceRecord]
    actor_tok: Any
    reward_tok: Any
    max_len: int
    summary: dict[str, Any] = field(default_factory=dict)

    def out(self, step: int) -> Path:
        return Path(self.opts.output) / STEP_DIRS[step]

    def share(self, step: int) -> list[PreferenceRecord]:
        return split_for_step(self.records, step, self.opts.data_split, self.opts.seed)


def _step1(run: _Run) -> None:
    o = run.opts
    model = load_lm(o.actor, run.actor_tok, run.max_len, o.seed)
    config = _engine_config(o.actor_config, o.batch_size, o.sft_lr, o.actor_zero_stage, None)
    engine, *_ = initialize(model=model, config=config)
    data, metrics, step = run.share(1), _MetricsFile(run.out(1) / "metrics.jsonl", engine, "sft"), 0
    for epoch in range(o.epochs_of(1)):
        for rows in _rank_batches(data, _per_rank(engine), epoch, o.seed, "step 1's share"):
            step += 1
            loss = _sft_step(engine, sft_batch(run.actor_tok, rows, o.max_seq_len))
            metrics.write({"step": step, "epoch": epoch, "loss": loss})
            run.summary["step1_loss"] = loss
        log_rank0("chat step 1: epoch %d, loss %.4f", epoch, run.summary["step1_loss"])
    save_model(engine.module, run.actor_tok, run.out(1))
    engine.destroy()


def _step2(run: _Run) -> None:
    o = run.opts
    assert o.reward is not None
    rm = load_reward_model(o.reward, run.reward_tok, run.max_len, o.seed)
    config = _engine_config(o.critic_config, o.batch_size, o.reward_lr, o.critic_zero_stage, None)
    engine, *_ = initialize(model=rm, config=config)
    data, metrics, step = (
        run.share(2),
        _MetricsFile(run.out(2) / "metrics.jsonl", engine, "reward"),
        0,
    )
    pad = int(run.reward_tok.pad_token_id)
    for epoch in range(o.epochs_of(2)):
        for rows in _rank_batches(data, _per_rank(engine), epoch, o.seed, "step 2's share"):
            step += 1
            out = reward_step(engine, pair_batch(run.reward_tok, rows, o.max_seq_len), pad)
            row = {
                "step": step, "epoch": epoch, "loss": float(out.loss),
                "accuracy": float(out.accuracy),
                "chosen_score": float(out.chosen_scores.mean()),
                "rejected_score": float(out.rejected_scores.mean()),
            }  # fmt: skip
            metrics.write(row)
            run.summary["step2_loss"], run.summary["step2_accuracy"] = row["loss"], row["accuracy"]
        log_rank0(
            "chat step 2: epoch %d, loss %.4f, accuracy %.3f",
            epoch, run.summary["step2_loss"], run.summary["step2_accuracy"],
        )  # fmt: skip
    save_model(engine.module, run.reward_tok, run.out(2))
    engine.destroy()


def _lora_policies(o: ChatOptions) -> tuple[LoRAPolicy, LoRAPolicy]:
    """The actor's and the critic's LoRA (validated before any step runs)."""
    if o.only_optimize_lora and o.actor_lora_dim == 0 and o.critic_lora_dim == 0:
        raise ConfigError(
            "--only-optimize-lora needs --actor-lora-dim and/or --critic-lora-dim > 0 (there "
            "are no adapters to train otherwise)"
        )
    actor = LoRAPolicy(
        o.actor_lora_dim, o.actor_lora_module_name,
        only_optimize_lora=o.only_optimize_lora and o.actor_lora_dim > 0,
    )  # fmt: skip
    critic_only = o.only_optimize_lora and o.critic_lora_dim > 0
    critic = LoRAPolicy(
        o.critic_lora_dim, o.critic_lora_module_name, only_optimize_lora=critic_only,
        force_optimize=("v_head.weight",) if critic_only else (),
    )  # fmt: skip
    return actor, critic


def _frozen(model: nn.Module, offload: bool) -> nn.Module:
    """A reference or reward model for PPO: frozen, host-resident with ``offload``."""
    model.requires_grad_(False)
    if offload:
        offload_frozen_(model)
    return model


def _step3(run: _Run, actor_spec: str, reward_spec: str) -> None:
    o = run.opts
    if model_kind(actor_spec, "actor") == "preset":
        log_rank0("chat step 3: the actor %s is untrained (no SFT)", actor_spec)

    def lm() -> nn.Module:
        return load_lm(actor_spec, run.actor_tok, run.max_len, o.seed)

    def rm() -> RewardModel:
        return load_reward_model(reward_spec, run.reward_tok, run.max_len, o.seed)

    hybrid = o.max_prompt_len + o.max_answer_len
    actor_cfg = _engine_config(o.actor_config, o.batch_size, o.actor_lr, o.actor_zero_stage, hybrid)
    critic_cfg = _engine_config(
        o.critic_config, o.batch_size, o.critic_lr, o.critic_zero_stage, None
    )
    actor_lora, critic_lora = _lora_policies(o)
    actor_model, critic_model = lm(), rm()
    apply_lora_policy_(actor_model, actor_lora)
    apply_lora_policy_(critic_model, critic_lora)
    ema = copy.deepcopy(actor_model) if o.enable_ema else None
    actor, *_ = initialize(model=actor_model, config=actor_cfg)
    critic, *_ = initialize(model=critic_model, config=critic_cfg)
    ppo = PPOConfig(
        max_new_tokens=o.max_answer_len, kl_coef=o.kl_coef, temperature=o.temperature,
        seed=o.seed, ptx_coef=o.ptx_coef, align_overflow=o.align_overflow,
    )  # fmt: skip
    tok = run.actor_tok
    trainer = PPOTrainer(
        actor, critic, _frozen(lm(), o.offload_reference_model),
        _frozen(rm(), o.offload_reward_model), ppo, ema=ema, log_path=None,
        pad_token_id=int(tok.pad_token_id), eos_token_id=int(tok.eos_token_id),
    )  # fmt: skip
    metrics = _MetricsFile(run.out(3) / "ppo.jsonl", None, "ppo")  # the trainer writes events
    ptx_texts = _read_texts(o.unsupervised_data) if o.unsupervised_data else None
    data, per_rank, last = run.share(3), _per_rank(actor), None
    for epoch in range(o.epochs_of(3)):
        batches = _rank_batches(data, per_rank, epoch, o.seed, "step 3's share")
        for i, rows in enumerate(batches):
            prompts = prompt_batch(tok, rows, o.max_prompt_len, o.drop_long_prompts)
            ptx = None
            if ptx_texts:
                ptx = text_batch(tok, _ptx_rows(ptx_texts, i, per_rank), o.max_seq_len)
            m = trainer.step(prompts.input_ids, prompts.attention_mask, ptx)
            if m is not None:
                metrics.write(asdict(m))
                last = m
    if last is not None:
        run.summary.update(_ppo_summary(last))
    out = run.out(3)
    save_model(actor.module, tok, out / "actor")
    save_model(critic.module, run.reward_tok, out / "critic")
    if ema is not None:
        save_model(ema, tok, out / "actor_ema")
    _plot(out)
    actor.destroy()
    critic.destroy()


def _ptx_rows(texts: list[str], step: int, n: int) -> list[str]:
    """Step ``step``'s PTX texts for this rank (cycling through ``texts``)."""
    start = (step * comm.get_world_size() + comm.get_rank()) * n
    return [texts[(start + j) % len(texts)] for j in range(n)]


def _ppo_summary(m: PPOMetrics) -> dict[str, Any]:
    return {"step3_reward_mean": m.reward_mean, "step3_kl": m.kl, "step3_steps": m.step}


def _plot(directory: Path) -> None:
    """Step 3's reward and KL curves side by side (``plots/summary.png``) when matplotlib is
    installed; ``slipstream plot`` draws every metric."""
    if comm.get_rank() != 0:
        return
    from slipstream.profiling.plots import plot_run

    try:
        plot_run(directory, directory / "plots", summary_only=True)
    except ImportError as e:
        log_rank0("chat: no plot of step 3 (%s); `slipstream plot %s` draws it later", e, directory)


def _load_records(opts: ChatOptions) -> list[PreferenceRecord]:
    return load_preference_records(opts.data)


def _steps(step: str) -> list[int]:
    if step == "all":
        return [1, 2, 3]
    if step in ("1", "2", "3"):
        return [int(step)]
    raise ConfigError(f"--step {step!r}: use 1, 2, 3 or all")


def run_chat(opts: ChatOptions) -> dict[str, Any]:
    """Run the steps ``opts.step`` names; returns a summary (last losses, accuracy, PPO
    reward and KL). Everything checkable is checked before training: the steps, the data
    (every record), the models' kinds, the two tokenizers agree, the prompts fit.

    Raises:
        ConfigError: bad input, named.
    """
    steps = _steps(opts.step)
    _lora_policies(opts)
    raw = _load_records(opts)
    if (2 in steps or 3 in steps) and opts.reward is None:
        raise ConfigError(
            "--reward is required for steps 2 and 3 (a model directory or gpt:PRESET)"
        )
    texts = [r.prompt + r.chosen + r.rejected for r in raw]
    if opts.unsupervised_data:
        texts += _read_texts(opts.unsupervised_data)
    actor_tok = load_tokenizer(opts.actor, "actor", texts)
    reward_tok = load_tokenizer(opts.reward, "reward", texts) if opts.reward else actor_tok
    records = apply_chat_template(actor_tok, raw)
    sample = [r.prompt + r.chosen for r in records[:8]]
    if opts.reward is not None and 3 in steps:
        check_same_tokenizer(actor_tok, reward_tok, sample)
    if steps == [3]:
        require_trained_reward_model(str(opts.reward))
    if 3 in steps:  # refuse over-long prompts now, not after steps 1 and 2
        share = split_for_step(records, 3, opts.data_split, opts.seed)
        prompt_batch(actor_tok, share, opts.max_prompt_len, opts.drop_long_prompts)
    max_len = max(opts.max_seq_len, opts.max_prompt_len + opts.max_answer_len)
    comm.init_distributed()
    run = _Run(opts, records, actor_tok, reward_tok, max_len)
    actor, reward = opts.actor, opts.reward
    for step in steps:
        log_rank0("chat: step %d -> %s", step, run.out(step))
        if step == 1:
            _step1(run)
            actor = str(run.out(1))
        elif step == 2:
            _step2(run)
            reward = str(run.out(2))
        else:
            assert reward is not None
            _step3(run, actor, reward)
    comm.barrier()
    return run.summary
