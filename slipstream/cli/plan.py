"""``slipstream plan``: predict the memory and step time of a parallel layout, or search the
layouts that fit for the fastest (docs/planner.md).

Give the model (``--model PRESET`` or ``--layers/--hidden/--heads/--seq/--vocab``), the device
count and the hardware profile. When ``--tp``, ``--pp``, ``--micro-batch``, ``--zero-stage`` and
``--recompute`` are all given the layout is predicted as given; otherwise the missing fields are
searched and the top layouts printed. ``--write-config`` saves the chosen layout as a
slipstream/DeepSpeed JSON config. ``--calibrate`` measures this machine into the ``local``
profile.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_parser", "plan_command"]

_FULL = ("tp", "pp", "micro_batch", "zero_stage", "recompute")


def add_parser(subparsers: Any) -> None:
    """Register ``plan`` on the ``slipstream`` subcommand parser."""
    p = subparsers.add_parser(
        "plan", help="predict or search a parallel layout (memory, step time)",
        description=__doc__,
    )  # fmt: skip
    model = p.add_argument_group("model")
    model.add_argument("--model", help="a preset: megatron-22b, gpt3-175b, mt-nlg-530b, "
                       "megatron-1t, frontier-22b, frontier-175b, frontier-1t")  # fmt: skip
    for flag, what in (("--layers", "transformer layers"), ("--hidden", "hidden size"),
                       ("--heads", "attention heads"), ("--seq", "sequence length (2048)"),
                       ("--vocab", "vocabulary size (51200)")):  # fmt: skip
        model.add_argument(flag, type=int, help=what)
    p.add_argument("--gpus", type=int, help="devices in the job")
    p.add_argument(
        "--hardware",
        default="dgx-a100-80gb",
        help="frontier-mi250x, dgx-a100-80gb, dgx-h100, local, or a profile JSON path",
    )
    lay = p.add_argument_group("layout (what is left out is searched)")
    lay.add_argument("--tp", type=int, help="tensor-parallel size")
    lay.add_argument("--pp", type=int, help="pipeline stages")
    lay.add_argument("--virtual-stages", type=int, help="model chunks per stage (interleaved)")
    lay.add_argument("--micro-batch", type=int, help="sequences per device per micro-step")
    lay.add_argument("--global-batch", type=int, help="sequences per step (default: --gpus)")
    lay.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), help="ZeRO stage")
    lay.add_argument("--recompute", choices=("none", "selective", "full"),
                     help="activation recomputation")  # fmt: skip
    lay.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None,
                     help="Megatron sequence parallelism inside the TP group")  # fmt: skip
    p.add_argument("--top", type=int, default=5, help="layouts to print when searching")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--write-config", type=Path, help="write the chosen layout as a JSON config")
    p.add_argument("--calibrate", action="store_true",
                   help="measure this machine into the 'local' profile and exit")  # fmt: skip
    p.add_argument("--nproc", type=int, default=None,
                   help="with --calibrate: ranks that will share this machine (default: the "
                   "GPUs, or 2 on a CPU); each is measured while all of them run")  # fmt: skip
    p.set_defaults(handler=plan_command)


def _model(args: argparse.Namespace) -> Any:
    from slipstream.planner import megatron_gpt, model_preset

    extra = {k: getattr(args, k) for k in ("seq", "vocab") if getattr(args, k)}
    if args.model:
        shape = {k: getattr(args, k) for k in ("layers", "hidden", "heads") if getattr(args, k)}
        return model_preset(args.model, **shape, **extra)
    missing = [f"--{k}" for k in ("layers", "hidden", "heads") if not getattr(args, k)]
    if missing:
        raise ValueError(f"give --model PRESET or all of --layers --hidden --heads (missing "
                         f"{' '.join(missing)})")  # fmt: skip
    return megatron_gpt(args.layers, args.hidden, args.heads, **extra)


def _fixed(args: argparse.Namespace) -> dict[str, Any]:
    keys = ("tp", "pp", "virtual_stages", "micro_batch", "zero_stage", "recompute",
            "sequence_parallel")  # fmt: skip
    return {k: getattr(args, k) for k in keys if getattr(args, k) is not None}


def _summary(p: Any) -> str:
    lay, mem, t = p.layout, p.memory, p.time
    return (
        f"tp={lay.tp} pp={lay.pp} dp={lay.dp} v={lay.virtual_stages} mb={lay.micro_batch} "
        f"gb={lay.batch} zero={lay.zero_stage} recompute={lay.recompute} "
        f"sp={'on' if lay.sequence_parallel else 'off'}\n"
        f"    step {p.step_time_s:.3f} s, {p.tflops_per_device:.1f} TFLOP/s per device "
        f"({p.percent_of_peak:.1f}% of peak), memory {mem.total / 2**30:.2f} GiB ({mem.stage} "
        f"stage: params {mem.params / 2**30:.2f}, grads {mem.grads / 2**30:.2f}, optimizer "
        f"{mem.optimizer / 2**30:.2f}, activations {mem.activations / 2**30:.2f}, buffers "
        f"{mem.comm_buffers / 2**30:.2f})\n"
        f"    time: compute {t.compute_s:.3f} elementwise {t.elementwise_s:.3f} tp "
        f"{t.tp_comm_s:.3f} pp {t.pp_comm_s:.3f} bubble {t.bubble_s:.3f} dp exposed "
        f"{t.dp_exposed_s:.3f} optimizer {t.optimizer_s:.3f}"
    )


def _run(args: argparse.Namespace) -> int:
    from slipstream.planner import Layout, load_hardware, predict
    from slipstream.planner.export import layout_to_config
    from slipstream.planner.search import search

    model, hardware = _model(args), load_hardware(args.hardware)
    if not args.gpus or args.gpus < 1:
        raise ValueError("give --gpus N (the devices in the job)")
    batch = args.global_batch or args.gpus
    fixed = _fixed(args)
    if all(k in fixed for k in _FULL):
        dp, rem = divmod(args.gpus, fixed["tp"] * fixed["pp"])
        if rem:
            raise ValueError(f"--gpus {args.gpus} is not a multiple of tp * pp = "
                             f"{fixed['tp'] * fixed['pp']}")  # fmt: skip
        ranked = [predict(model, hardware, Layout(dp=dp, global_batch=batch, **fixed))]
        header: dict[str, Any] = {"mode": "predict"}
    else:
        result = search(model, hardware, args.gpus, batch, fixed, top=args.top)
        ranked = result.ranked
        header = {"mode": "search", "enumerated": result.enumerated,
                  "rejected_memory": result.rejected_memory}  # fmt: skip
        if not ranked:
            raise ValueError(f"none of the {result.enumerated} layouts fits in "
                             f"{hardware.usable_memory / 2**30:.1f} GiB per device; use more "
                             "devices, recompute, ZeRO or a smaller micro-batch")  # fmt: skip
    if args.write_config:
        args.write_config.write_text(json.dumps(layout_to_config(ranked[0].layout), indent=2))
    if args.json:
        out = {**header, **ranked[0].to_dict(), "ranked": [p.to_dict() for p in ranked]}
        print(json.dumps(out, indent=2))
    else:
        print(f"{model.name or 'model'}: {model.num_params() / 1e9:.2f}B parameters on "
              f"{args.gpus} x {hardware.name} ({header['mode']})")  # fmt: skip
        for i, p in enumerate(ranked, 1):
            print(f"{i}. {_summary(p)}")
    return 0


def plan_command(args: argparse.Namespace) -> int:
    """Handler of ``slipstream plan``; bad input exits 2 with the reason on stderr."""
    try:
        if args.calibrate:
            from slipstream.planner.calibrate import calibrate

            profile = calibrate(nproc=args.nproc)
            print(json.dumps(profile.to_dict(), indent=2) if args.json else
                  f"wrote the 'local' profile: {profile.peak_tflops:.3f} TFLOP/s GEMM, "
                  f"{profile.intra_node[0].bandwidth_gbps:.2f} GB/s all-reduce")  # fmt: skip
            return 0
        return _run(args)
    except ValueError as err:
        print(f"slipstream plan: error: {err}", file=sys.stderr)
        return 2
