"""Rank-side runs of the Hugging Face Trainer with ``TrainingArguments(deepspeed=config)``:
a tiny GPT-2 saved with ``save_pretrained`` and loaded with ``from_pretrained`` (at ZeRO-3
under the Trainer's ``HfDeepSpeedConfig``, so through ``zero.Init``), "auto" values
everywhere, four steps checkpointing every two, then a second Trainer resuming from the
step-2 checkpoint. Under slipstream (``SLIPSTREAM_AS_DEEPSPEED=1``) or DeepSpeed."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

AUTO = "auto"


def save_tiny_gpt2(path: str) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=64,
        n_positions=32,
        n_embd=16,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    GPT2LMHeadModel(config).save_pretrained(path)


def ds_config(stage: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": AUTO,
        "train_batch_size": AUTO,
        "gradient_accumulation_steps": AUTO,
        "gradient_clipping": AUTO,
        "optimizer": {
            "type": "AdamW",
            "params": dict.fromkeys(("lr", "betas", "eps", "weight_decay"), AUTO),
        },
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": dict.fromkeys(
                ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps"), AUTO
            ),
        },
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": AUTO,
            "stage3_prefetch_bucket_size": AUTO,
            "stage3_param_persistence_threshold": AUTO,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "bf16": {"enabled": AUTO},
        "fp16": {"enabled": AUTO},
    }


def _train(model_dir: str, stage: int, out: str, resume: str | None) -> list[float]:
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=out,
        deepspeed=ds_config(stage),
        max_steps=4,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        warmup_steps=1,
        save_steps=2,
        logging_steps=1,
        report_to=[],
        seed=0,
        use_cpu=True,
        disable_tqdm=True,
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    g = torch.Generator().manual_seed(3)
    data = [{"input_ids": x, "labels": x} for x in torch.randint(0, 64, (16, 12), generator=g)]
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train(resume_from_checkpoint=resume)
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def trainer_runs(workdir: str, name: str) -> dict[str, Any]:
    """Stages 2 and 3: the losses of four steps, and of a run resumed from step 2."""
    if name == "deepspeed":
        from tests.compat._deepspeed import import_deepspeed

        import_deepspeed().init_distributed()
    out: dict[str, Any] = {}
    for stage in (2, 3):
        run_dir = str(Path(workdir, name, f"zero{stage}"))
        first = _train(str(Path(workdir, "tiny-gpt2")), stage, run_dir, None)
        resumed = _train(
            str(Path(workdir, "tiny-gpt2")), stage, run_dir, os.path.join(run_dir, "checkpoint-2")
        )
        out[stage] = {"losses": first, "resumed": resumed, "dir": run_dir}
    return out
