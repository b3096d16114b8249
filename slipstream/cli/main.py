"""``slipstream`` command-line entry point: subcommand dispatch.

Each subcommand module exposes ``add_parser(subparsers)``, which registers its parser with a
``handler(args) -> int`` default; :func:`main` returns that handler's exit code.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
import textwrap
from typing import Any

from slipstream.cli import (
    chat,
    convert,
    generate,
    launcher,
    plan,
    plot,
    quant,
    report,
    serve,
    tune,
)
from slipstream.version import __version__

__all__ = ["PlainTextFormatter", "build_parser", "main", "plain_text"]

_DEMO_MODULE = "slipstream.cli.demo"

# reStructuredText inline markup of our docstrings: :role:`~a.b`, ``literal``, `text`.
_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")
_LITERAL = re.compile(r"``([^`]+)``|`([^`]+)`")


def plain_text(text: str) -> str:
    """``text`` (a docstring) without reStructuredText inline markup, for terminal help."""
    text = _ROLE.sub(lambda m: m.group(1), text)
    return _LITERAL.sub(lambda m: m.group(1) or m.group(2), text)


class PlainTextFormatter(argparse.HelpFormatter):
    """Help from docstrings as plain text: markup removed, paragraphs kept apart."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        paragraphs = re.split(r"\n\s*\n", plain_text(text).strip())
        filled = (
            textwrap.fill(" ".join(p.split()), width, initial_indent=indent,
                          subsequent_indent=indent)
            for p in paragraphs
        )  # fmt: skip
        return "\n\n".join(filled)

    def _expand_help(self, action: argparse.Action) -> str:
        return plain_text(super()._expand_help(action))


class _Parser(argparse.ArgumentParser):
    """Every ``slipstream`` parser, subcommands included, formats help as plain text."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", PlainTextFormatter)
        super().__init__(*args, **kwargs)


def _add_demo_parser(subparsers: Any, load: bool) -> None:
    """Register ``demo``. Its module is imported only when ``demo`` is the command (``load``),
    so other commands never pay for it; if it is absent, ``demo`` explains that and exits 2."""
    if load:
        try:
            demo = importlib.import_module(_DEMO_MODULE)
        except ModuleNotFoundError as err:
            if err.name != _DEMO_MODULE:
                raise  # demo exists but one of its own imports is missing: show that
        else:
            demo.add_parser(subparsers)
            return
    p = subparsers.add_parser("demo", help="run a built-in demo (slipstream demo --help)")
    p.add_argument("demo_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    p.set_defaults(handler=_demo_missing)


def _demo_missing(args: argparse.Namespace) -> int:
    print(
        f"slipstream demo: error: this slipstream install has no demo module ({_DEMO_MODULE}); "
        "reinstall slipstream or use `slipstream run` with your own script",
        file=sys.stderr,
    )
    return 2


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``slipstream`` parser with every subcommand registered (``command``: the one that
    will run, so that only its module is imported when that is costly)."""
    parser = _Parser(
        prog="slipstream",
        description="slipstream: large-model training on plain PyTorch (DeepSpeed-compatible).",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"slipstream {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    launcher.add_parser(subparsers)
    report.add_parser(subparsers)
    convert.add_parser(subparsers)
    quant.add_parser(subparsers)
    plot.add_parser(subparsers)
    plan.add_parser(subparsers)
    tune.add_parser(subparsers)
    generate.add_parser(subparsers)
    chat.add_parser(subparsers)
    serve.add_parser(subparsers)
    _add_demo_parser(subparsers, load=command == "demo")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the subcommand, return its exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command)
    args = parser.parse_args(argv)
    if getattr(args, "handler", None) is None:
        parser.print_help(sys.stderr)
        return 2
    finish = getattr(sys.modules.get("slipstream"), "_finish_init", None)
    if finish is not None:  # started from _slipstream_cli: now import slipstream for real
        finish()
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
