"""``slipstream demo``: train the reference GPT on the embedded corpus on N local processes.

The parent process only launches; every rank runs ``slipstream.cli._demo_worker`` through
the same launcher as ``slipstream run``, so the demo exercises the real multi-process path.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

__all__ = ["add_parser", "demo_command"]


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "demo",
        help="train a small GPT on the embedded corpus with ZeRO on N local processes",
        description=(
            "Train the reference GPT on Python standard-library source text (no download) on "
            "N local processes with ZeRO, report the loss drop and throughput, then sample."
        ),
    )
    add_worker_arguments(p)
    p.add_argument("--nproc", type=int, default=2, help="processes (default 2)")
    p.set_defaults(handler=demo_command)


def add_worker_arguments(p: argparse.ArgumentParser) -> None:
    """Options shared by the launcher side and the worker side."""
    p.add_argument(
        "--preset", default="small", help="model size: tiny, small or 25m (default small)"
    )
    p.add_argument("--steps", type=int, default=200, help="optimizer steps (default 200)")
    p.add_argument(
        "--zero-stage", type=int, default=3, choices=[0, 1, 2, 3], help="ZeRO stage (default 3)"
    )
    p.add_argument(
        "--micro-batch", type=int, default=4, help="sequences per rank per step (default 4)"
    )
    p.add_argument(
        "--grad-accum", type=int, default=1, help="gradient accumulation steps (default 1)"
    )
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default 2e-3)")
    p.add_argument(
        "--precision",
        default="auto",
        choices=["auto", "fp32", "bf16"],
        help="auto: bf16 on GPU, fp32 on CPU",
    )
    p.add_argument(
        "--sample-tokens", type=int, default=200, help="tokens to sample at the end (default 200)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--run-dir",
        default=os.path.join("runs", "demo"),
        help="where the monitor CSVs, the FLOPs profile and the plots go (default runs/demo)",
    )


def demo_command(args: argparse.Namespace) -> int:
    from slipstream.cli.launcher import LocalPlan, launch_local

    if args.nproc < 1:
        print(f"slipstream demo: error: --nproc must be >= 1, got {args.nproc}", file=sys.stderr)
        return 2
    forwarded = [
        f"--preset={args.preset}",
        f"--steps={args.steps}",
        f"--zero-stage={args.zero_stage}",
        f"--micro-batch={args.micro_batch}",
        f"--grad-accum={args.grad_accum}",
        f"--seq-len={args.seq_len}",
        f"--lr={args.lr}",
        f"--precision={args.precision}",
        f"--sample-tokens={args.sample_tokens}",
        f"--seed={args.seed}",
        f"--run-dir={args.run_dir}",
    ]
    plan = LocalPlan(
        nproc=args.nproc,
        entrypoint=sys.executable,
        entry_args=["-m", "slipstream.cli._demo_worker", *forwarded],
    )
    return launch_local(plan)
