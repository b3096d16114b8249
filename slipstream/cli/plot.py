"""``slipstream plot RUN_DIR``: a run's monitor scalars (CSV, TensorBoard or JSON lines) as PNG plots."""

from __future__ import annotations

import argparse
import sys
from typing import Any

__all__ = ["add_parser"]


def add_parser(subparsers: Any) -> None:
    """Register ``plot`` on the ``slipstream`` subcommand parser."""
    p = subparsers.add_parser(
        "plot",
        help="draw a run's monitor scalars (loss, lr, throughput, MFU, ...) as PNG files",
        description=__doc__,
    )
    p.add_argument(
        "run_dir",
        help="a directory holding csv_monitor files, TensorBoard events or JSON-lines metrics",
    )
    p.add_argument("--out", default=None, help="where the PNGs go (default RUN_DIR/plots)")
    p.set_defaults(handler=plot_command)


def plot_command(args: argparse.Namespace) -> int:
    """Handler of ``slipstream plot``."""
    from slipstream.profiling.plots import plot_run

    try:
        written = plot_run(args.run_dir, args.out)
    except (FileNotFoundError, ImportError) as e:
        print(f"slipstream plot: error: {e}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0
