"""``slipstream convert CKPT_DIR OUT_DIR``: checkpoint -> consolidated safetensors model.

Streams tensor by tensor (peak memory about the largest tensor), from any world size and ZeRO
stage; the output loads with ``transformers``' ``from_pretrained`` when the checkpoint was of a
Hugging Face model. ``--to slipstream`` turns a DeepSpeed checkpoint into a slipstream one;
``--to deepspeed`` writes a slipstream checkpoint in DeepSpeed's ZeRO-1/2 or ZeRO-3 layout.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

__all__ = ["add_parser"]


def add_parser(subparsers: Any) -> None:
    """Register ``convert`` on the ``slipstream`` subcommand parser."""
    p = subparsers.add_parser(
        "convert",
        help="export a checkpoint as a consolidated safetensors model (like zero_to_fp32)",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("checkpoint", help="a checkpoint tag directory, or a save dir with 'latest'")
    p.add_argument("out_dir", help="output directory")
    p.add_argument(
        "--dtype", choices=["fp32", "bf16", "fp16"], default=None,
        help="output dtype (default: each parameter's training dtype; fp32 uses the masters)",
    )  # fmt: skip
    p.add_argument("--max-shard-size", default="5GB", help="largest output shard (default 5GB)")
    p.add_argument(
        "--to", choices=["safetensors", "slipstream", "deepspeed"], default="safetensors",
        help="safetensors: a consolidated model (default); slipstream: a DeepSpeed checkpoint "
        "as a slipstream checkpoint; deepspeed: a slipstream checkpoint in DeepSpeed's layout",
    )  # fmt: skip
    p.add_argument(
        "--world-size", type=int, default=None,
        help="--to deepspeed: the DeepSpeed data-parallel world to lay out for (default: saved)",
    )  # fmt: skip
    p.add_argument(
        "--zero-stage", type=int, default=2, choices=[1, 2, 3],
        help="--to deepspeed: the ZeRO stage DeepSpeed will load it at (default 2)",
    )  # fmt: skip
    p.add_argument(
        "--sub-group-size", type=int, default=1_000_000_000,
        help="--to deepspeed --zero-stage 3: the DeepSpeed run's zero_optimization."
        "sub_group_size (default 1e9, DeepSpeed's default)",
    )  # fmt: skip
    p.set_defaults(handler=convert_command)


def convert_command(args: argparse.Namespace) -> int:
    """Handler of ``slipstream convert``."""
    from slipstream.checkpoint import (
        CheckpointError,
        convert_checkpoint,
        deepspeed_to_slipstream,
        export_deepspeed,
    )

    try:
        if args.to == "slipstream":
            path = deepspeed_to_slipstream(args.checkpoint, args.out_dir)
        elif args.to == "deepspeed":
            path = export_deepspeed(
                args.checkpoint,
                args.out_dir,
                args.world_size,
                args.zero_stage,
                sub_group_size=args.sub_group_size,
            )
        else:
            path = convert_checkpoint(
                args.checkpoint, args.out_dir, args.dtype, args.max_shard_size
            )
    except (CheckpointError, ValueError) as e:
        print(f"slipstream convert: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0
