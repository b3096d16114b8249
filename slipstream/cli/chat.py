"""``slipstream chat --actor MODEL --reward MODEL --data DIR``: DeepSpeed-Chat's three RLHF
steps (SFT, reward model, PPO) in one command (its ``e2e_rlhf.py``).

MODEL is a local Hugging Face model directory or ``gpt:PRESET`` (slipstream's reference GPT
with a character tokenizer built from the data). DIR holds ``train.json`` / ``train.jsonl``
records ``{"prompt", "chosen", "rejected"}`` (or is one such file, or a Hugging Face
``datasets`` directory written by ``save_to_disk``). Each step's model goes to
OUTPUT/step1_sft, step2_reward, step3_rlhf; ``--step all`` passes them on. Across processes:
``slipstream run --nproc N -m slipstream.cli.main chat ...``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

__all__ = ["add_parser", "chat_command"]


def add_parser(subparsers: Any) -> None:
    """Register ``chat`` on the ``slipstream`` parser."""
    p = subparsers.add_parser(
        "chat",
        help="DeepSpeed-Chat RLHF: SFT, reward model and PPO in one command",
        description=__doc__,
    )
    p.add_argument("--actor", required=True, help="actor: HF model directory or gpt:PRESET")
    p.add_argument(
        "--reward", default=None,
        help="reward model: an LM to start step 2 from (HF directory or gpt:PRESET), or step "
        "2's output for --step 3",
    )  # fmt: skip
    p.add_argument("--data", required=True, help="preference records (directory or file)")
    p.add_argument("--output", required=True, help="where the steps' models and metrics go")
    p.add_argument("--step", default="all", choices=["1", "2", "3", "all"])
    p.add_argument("--data-split", default="2,4,4", help="shares of steps 1, 2, 3")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--epochs", type=int, default=1, help="passes over each step's share")
    for k in (1, 2, 3):
        p.add_argument(f"--step{k}-epochs", type=int, default=None, help=f"step {k}'s epochs")
    p.add_argument("--batch-size", type=int, default=4, help="records per rank per step")
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--max-prompt-len", type=int, default=256)
    p.add_argument("--max-answer-len", type=int, default=256, help="PPO's new tokens")
    p.add_argument("--sft-lr", type=float, default=9.65e-6)
    p.add_argument("--reward-lr", type=float, default=5e-5)
    p.add_argument("--actor-lr", type=float, default=9.65e-6)
    p.add_argument("--critic-lr", type=float, default=5e-6)
    p.add_argument("--actor-zero-stage", type=int, default=0)
    p.add_argument("--critic-zero-stage", type=int, default=0)
    p.add_argument("--actor-config", default=None, help="DeepSpeed JSON config of the actor")
    p.add_argument("--critic-config", default=None, help="DeepSpeed JSON config of RM/critic")
    p.add_argument("--kl-coef", type=float, default=0.1)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument(
        "--unsupervised-data", default=None,
        help="PTX text: .txt (a text per line) or JSON records with 'text'",
    )  # fmt: skip
    p.add_argument("--ptx-coef", type=float, default=27.8, help="weight of the PTX LM loss")
    p.add_argument("--align-overflow", action="store_true", help="skip both steps on overflow")
    p.add_argument("--enable-ema", action="store_true", help="keep an EMA of the actor")
    p.add_argument(
        "--drop-long-prompts",
        action="store_true",
        help="skip prompts longer than --max-prompt-len (DeepSpeed-Chat's behaviour) "
        "instead of stopping with an error",
    )
    for model in ("actor", "critic"):
        p.add_argument(f"--{model}-lora-dim", type=int, default=0, help=f"{model} LoRA rank")
        p.add_argument(
            f"--{model}-lora-module-name", default="layers.", help=f"{model} layers to convert"
        )
    p.add_argument("--only-optimize-lora", action="store_true", help="train only the adapters")
    p.add_argument("--offload-reference-model", action="store_true", help="reference on host")
    p.add_argument("--offload-reward-model", action="store_true", help="reward model on host")
    p.set_defaults(handler=chat_command)


def chat_command(args: argparse.Namespace) -> int:
    """Handler of ``slipstream chat``: parse into ``ChatOptions``, run, print the summary."""
    from slipstream.config import ConfigError
    from slipstream.rlhf.e2e import ChatOptions, run_chat

    step_epochs = {k: getattr(args, f"step{k}_epochs") for k in (1, 2, 3)}
    names = set(ChatOptions.__dataclass_fields__) - {"step_epochs"}
    opts = ChatOptions(
        **{k: v for k, v in vars(args).items() if k in names},
        step_epochs={k: v for k, v in step_epochs.items() if v is not None},
    )
    try:
        summary = run_chat(opts)
    except ConfigError as err:
        print(f"slipstream chat: error: {err}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(summary))
    return 0
