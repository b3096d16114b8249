"""``slipstream quant eval MODEL --text FILE``: quality of a model under quantization configs.

Prints one row per configuration: held-out perplexity for a causal LM (a slipstream GPT
directory or a Hugging Face model), or the mean / min cosine similarity of mean-pooled sentence
embeddings to the unquantized model for an encoder (one sentence per line of ``--text``).

A slipstream GPT directory is the format of :mod:`slipstream.models.files` (what
``slipstream chat`` writes): ``gpt_config.json`` (the :class:`GPTConfig` fields),
``model.safetensors`` (its ``state_dict``) and the tokenizer it was trained with
(``tokenizer.json``; UTF-8 bytes without one).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_parser", "eval_command"]

_DEFAULT_CONFIGS = "fp32,w8a8-int,w8a8-int-attn-float,w8a8-fp8,w4a8-int4,w4a8-fp4,w4a8-fp4-lorc8"


def add_parser(subparsers: Any) -> None:
    """Register ``quant`` (with its ``eval`` subcommand) on the ``slipstream`` parser."""
    quant = subparsers.add_parser("quant", help="post-training quantization tools")
    sub = quant.add_subparsers(dest="quant_command", metavar="QUANT_COMMAND", required=True)
    p = sub.add_parser(
        "eval",
        help="perplexity / embedding cosine for a table of quantization configs",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("model", help="slipstream GPT directory or Hugging Face model path")
    p.add_argument("--text", required=True, help="UTF-8 text file (encoder: one sentence a line)")
    p.add_argument(
        "--task", choices=["auto", "causal", "encoder"], default="auto",
        help="causal: perplexity; encoder: cosine to fp32 (auto: from the model)",
    )  # fmt: skip
    p.add_argument(
        "--configs", default=_DEFAULT_CONFIGS,
        help="comma-separated rows, names from slipstream.quant.eval.EVAL_CONFIGS, e.g. "
        "w8a8-fp8-e5m2, w4a8-int4-lorc8 (default: %(default)s)",
    )  # fmt: skip
    p.add_argument("--seq-len", type=int, default=256, help="perplexity window (default 256)")
    p.add_argument("--max-tokens", type=int, default=4096, help="tokens evaluated (causal)")
    p.add_argument("--int-backend", choices=["int_mm", "fbgemm"], default="int_mm")
    p.add_argument("--group-size", type=int, default=64, help="4-bit weight group size")
    p.set_defaults(handler=eval_command)


def _is_causal_hf(path: str) -> bool:
    from transformers import AutoConfig

    archs = AutoConfig.from_pretrained(path, local_files_only=True).architectures or []
    return any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs)


def _causal(args: argparse.Namespace, text: str, configs: list[Any]) -> str:
    import torch

    from slipstream.models import files
    from slipstream.quant.eval import format_table, perplexity_rows

    if files.is_gpt_dir(args.model):
        model = files.load_gpt(args.model).eval()
        ids = torch.tensor(files.load_tokenizer(args.model).encode(text), dtype=torch.long)
    else:
        tok = files.load_hf_tokenizer(args.model)
        model = files.load_hf_model(args.model, "causal", torch.float32).eval()
        ids = tok(text, return_tensors="pt").input_ids[0]
    ids = ids[: args.max_tokens]
    rows = perplexity_rows(model, ids, args.seq_len, configs)
    note = f"({ids.numel()} tokens, windows of {args.seq_len})"
    return format_table(("config", "perplexity", "time s"), rows) + f"\n{note}"


def _encoder(args: argparse.Namespace, text: str, configs: list[Any]) -> str:
    import torch

    from slipstream.models import files
    from slipstream.quant.eval import cosine_rows, format_table

    sentences = [line.strip() for line in text.splitlines() if line.strip()]
    tok = files.load_hf_tokenizer(args.model)
    model = files.load_hf_model(args.model, "base", None).eval()
    batch = tok(sentences, padding=True, truncation=True, return_tensors="pt")
    mask = batch["attention_mask"].unsqueeze(-1).float()

    def embed(m: torch.nn.Module) -> torch.Tensor:
        return (m(**batch).last_hidden_state * mask).sum(1) / mask.sum(1)

    rows = cosine_rows(model, embed, configs)
    table = format_table(("config", "mean cos", "min cos"), rows)
    return table + f"\n({len(sentences)} sentences, mean-pooled embeddings vs fp32)"


def eval_command(args: argparse.Namespace) -> int:
    """Handler of ``slipstream quant eval``."""
    from slipstream.quant.eval import eval_configs

    try:
        names = [n.strip() for n in args.configs.split(",") if n.strip()]
        configs = eval_configs(names, args.int_backend, args.group_size)
        text = Path(args.text).read_text(encoding="utf-8")
        task = args.task
        if task == "auto":
            from slipstream.models.files import is_gpt_dir

            task = "causal" if is_gpt_dir(args.model) or _is_causal_hf(args.model) else "encoder"
        print(_causal(args, text, configs) if task == "causal" else _encoder(args, text, configs))
    except (OSError, ValueError) as e:
        print(f"slipstream quant eval: error: {e}", file=sys.stderr)
        return 2
    return 0
