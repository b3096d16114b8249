"""Offline stand-ins for what DeepSpeed-Chat's training scripts download: a tiny OPT with a
byte-level BPE tokenizer (saved with ``save_pretrained``, so ``from_pretrained`` and
``AutoTokenizer`` read it) and a preference dataset in ``Dahoas/rm-static``'s columns, saved
with ``datasets``' ``save_to_disk`` under a path that contains ``Dahoas/rm-static`` (the
scripts pick the dataset class by that name and load a local path with ``load_from_disk``).

Also the command lines of DeepSpeed-Chat's three steps (``deepspeed main.py ...``), for a
DeepSpeedExamples checkout given by path: nothing of it is copied here.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

_WORDS = [
    "the",
    "a",
    "one",
    "small",
    "large",
    "red",
    "blue",
    "green",
    "model",
    "data",
    "train",
    "step",
    "loss",
    "token",
    "human",
    "assistant",
    "answer",
    "question",
    "good",
    "bad",
    "river",
    "mountain",
    "city",
    "road",
    "light",
    "dark",
    "fast",
    "slow",
    "open",
    "close",
    "read",
    "write",
    "learn",
    "teach",
    "find",
    "lose",
    "make",
    "take",
    "give",
    "keep",
    "start",
    "stop",
    "plan",
    "test",
    "run",
    "walk",
]


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def build_tokenizer(path: Path) -> None:
    """A byte-level BPE (GPT-2's kind, as OPT's) over the stand-in vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2TokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "<pad>", "</s>", "<unk>"], show_progress=False
    )
    rng = random.Random(0)
    corpus = [_sentence(rng, 12) + " Human: Assistant:" for _ in range(400)]
    tok.train_from_iterator(corpus, trainer)
    fast = GPT2TokenizerFast(
        tokenizer_object=tok, bos_token="</s>", eos_token="</s>", unk_token="<unk>",
        pad_token="<pad>",
    )  # fmt: skip
    fast.save_pretrained(str(path))
    # OPT's tokenizer class (DeepSpeed-Chat saves it with save_vocabulary). transformers 5
    # may write its own backend class here, which transformers 4 (DeepSpeed-Chat imports
    # names 5 removed) cannot read.
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "GPT2TokenizerFast"
    config_file.write_text(json.dumps(config, indent=1))


def build_model(path: Path) -> None:
    """A 2-layer OPT (random weights) over the tokenizer's vocabulary, and the tokenizer."""
    import torch
    from transformers import AutoTokenizer, OPTConfig, OPTForCausalLM

    build_tokenizer(path)
    vocab = len(AutoTokenizer.from_pretrained(str(path)))
    config = OPTConfig(
        vocab_size=8 * -(-vocab // 8), hidden_size=32, num_hidden_layers=2,
        ffn_dim=64, num_attention_heads=4, max_position_embeddings=128,
        word_embed_proj_dim=32, pad_token_id=1, bos_token_id=2, eos_token_id=2,
        dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    OPTForCausalLM(config).save_pretrained(str(path))


def build_dataset(path: Path, n_train: int = 80, n_test: int = 16) -> None:
    """Prompt / response / chosen / rejected rows, as in ``Dahoas/rm-static``."""
    from datasets import Dataset, DatasetDict

    rng = random.Random(1)

    def rows(n: int) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {"prompt": [], "response": [], "chosen": [], "rejected": []}
        for _ in range(n):
            prompt = f"\n\nHuman: {_sentence(rng, 6)}?\n\nAssistant:"
            good, bad = _sentence(rng, 8), _sentence(rng, 3)
            out["prompt"].append(prompt)
            out["response"].append(" " + good)
            out["chosen"].append(" " + good)
            out["rejected"].append(" " + bad)
        return out

    DatasetDict(
        {"train": Dataset.from_dict(rows(n_train)), "test": Dataset.from_dict(rows(n_test))}
    ).save_to_disk(str(path))


def build(root: Path) -> dict[str, str]:
    """Model, tokenizer and data under ``root``; returns their paths."""
    model, data = root / "tiny-opt", root / "Dahoas" / "rm-static"
    build_model(model)
    build_dataset(data)
    return {"model": str(model), "data": str(data)}


def chat_dir(checkout: str | os.PathLike[str]) -> Path:
    return Path(checkout) / "applications" / "DeepSpeed-Chat"


def common_flags(assets: dict[str, str], work: Path, zero_stage: int) -> list[str]:
    return [
        "--data_path", assets["data"], "--data_split", "2,4,4",
        "--data_output_path", str(work / "data_files"),
        "--max_seq_len", "32", "--seed", "1234", "--dtype", "bf16",
        "--zero_stage", str(zero_stage), "--deepspeed",
    ]  # fmt: skip


def step1_args(assets: dict[str, str], work: Path, zero_stage: int) -> list[str]:
    return [
        "main.py", *common_flags(assets, work, zero_stage),
        "--model_name_or_path", assets["model"],
        "--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "2",
        "--learning_rate", "1e-3", "--weight_decay", "0.", "--num_train_epochs", "1",
        "--gradient_accumulation_steps", "1", "--lr_scheduler_type", "cosine",
        "--num_warmup_steps", "0", "--print_loss", "--output_dir", str(work / "actor"),
    ]  # fmt: skip


def step2_args(assets: dict[str, str], work: Path, zero_stage: int) -> list[str]:
    return [
        "main.py", *common_flags(assets, work, zero_stage),
        "--model_name_or_path", assets["model"], "--num_padding_at_beginning", "1",
        "--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "2",
        "--learning_rate", "1e-3", "--weight_decay", "0.1", "--num_train_epochs", "1",
        "--gradient_accumulation_steps", "1", "--lr_scheduler_type", "cosine",
        "--num_warmup_steps", "0", "--output_dir", str(work / "critic"),
    ]  # fmt: skip


def step3_args(assets: dict[str, str], work: Path, zero_stage: int, trained: Path) -> list[str]:
    """``trained``: the directory whose ``actor`` and ``critic`` steps 1 and 2 wrote."""
    flags = common_flags(assets, work, zero_stage)
    for name in ("--zero_stage", "--max_seq_len"):  # step 3 has per-actor/critic flags
        flags = flags[: flags.index(name)] + flags[flags.index(name) + 2 :]
    return [
        "main.py", *flags,
        "--actor_model_name_or_path", str(trained / "actor"),
        "--critic_model_name_or_path", str(trained / "critic"),
        "--num_padding_at_beginning", "1",
        "--per_device_generation_batch_size", "2", "--per_device_training_batch_size", "2",
        "--generation_batches", "1", "--ppo_epochs", "1",
        "--max_answer_seq_len", "8", "--max_prompt_seq_len", "16",
        "--actor_learning_rate", "1e-4", "--critic_learning_rate", "1e-4",
        "--num_train_epochs", "1", "--lr_scheduler_type", "cosine",
        "--gradient_accumulation_steps", "1", "--actor_dropout", "0.0",
        "--num_warmup_steps", "0", "--enable_hybrid_engine",
        "--actor_zero_stage", str(zero_stage), "--critic_zero_stage", str(zero_stage),
        "--enable_ema", "--output_dir", str(work / "rlhf"),
    ]  # fmt: skip
