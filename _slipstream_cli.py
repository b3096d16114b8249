"""The ``slipstream`` command's entry point: parse first, import torch and slipstream after.

``import slipstream`` imports torch and every subsystem (10-20 s on a loaded machine), and
importing any ``slipstream.cli`` module runs it first. So this top-level module makes the
``slipstream`` package object without running its ``__init__``, lets
:mod:`slipstream.cli.main` build the parsers (its modules import nothing heavy) and parse, and
:func:`slipstream.cli.main.main` runs the package's ``__init__`` in place just before a
command's handler: ``--help``, ``--version`` and argument errors never import torch.
"""

from __future__ import annotations

import importlib.util
import sys

__all__ = ["main"]


def _defer_package_init() -> None:
    """Put the ``slipstream`` package in ``sys.modules`` uninitialized, with the function
    that initializes it in place as ``_finish_init`` (not when it is already imported)."""
    if "slipstream" in sys.modules:
        return
    spec = importlib.util.find_spec("slipstream")
    if spec is None or spec.loader is None:
        return  # not installed: the import below says so
    package = importlib.util.module_from_spec(spec)
    loader = spec.loader

    def finish() -> None:
        del package._finish_init  # type: ignore[attr-defined]
        loader.exec_module(package)

    package._finish_init = finish  # type: ignore[attr-defined]
    sys.modules["slipstream"] = package


def main() -> int:
    _defer_package_init()
    from slipstream.cli.main import main as run

    return run()


if __name__ == "__main__":
    sys.exit(main())
