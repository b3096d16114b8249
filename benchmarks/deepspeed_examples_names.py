"""Which ``deepspeed.*`` names that DeepSpeedExamples uses resolve, on slipstream and on DeepSpeed.

Reads every ``.py`` file of a DeepSpeedExamples checkout (given by path; nothing of it is
copied here) and collects the DeepSpeed names it uses: ``import deepspeed.X``, ``from
deepspeed.X import Y``, and attribute chains on a name bound to a DeepSpeed module
(``deepspeed.zero.Init``, ``dist.get_rank`` after ``import deepspeed.comm as dist``). Each
name is then resolved in a fresh interpreter: imported as a module, or as an attribute chain
of the longest module prefix that imports. Once with ``SLIPSTREAM_AS_DEEPSPEED=1``
(slipstream) and, with ``--deepspeed``, once without (the installed DeepSpeed, on its CPU
accelerator).

    python benchmarks/deepspeed_examples_names.py /path/to/DeepSpeedExamples [--deepspeed]

Prints the counts (unique names and uses) and the names that fail on slipstream, with where
they are used and whether DeepSpeed resolves them; ``--json FILE`` writes everything.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

_RESOLVE = r"""
import importlib, json, logging, os, sys
logging.disable(logging.WARNING)
names = json.load(sys.stdin)
out = {}
for name in names:
    parts = name.split(".")
    obj, err = None, None
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except Exception as exc:
            err = f"{type(exc).__name__}: {exc}"
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
            err = None
        except Exception as exc:
            err = f"{type(exc).__name__}: {exc}"
        break
    out[name] = err
print(json.dumps(out))
"""


class _Uses(ast.NodeVisitor):
    """The DeepSpeed names one file uses (dotted, from ``deepspeed``), with line numbers."""

    def __init__(self) -> None:
        self.bound: dict[str, str] = {}  # local name -> the deepspeed module or name it is
        self.uses: list[tuple[str, int]] = []

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            if a.name == "deepspeed" or a.name.startswith("deepspeed."):
                self.uses.append((a.name, node.lineno))
                if a.asname:
                    self.bound[a.asname] = a.name
                else:
                    self.bound["deepspeed"] = "deepspeed"

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        mod = node.module or ""
        if node.level or not (mod == "deepspeed" or mod.startswith("deepspeed.")):
            return
        for a in node.names:
            if a.name == "*":
                self.uses.append((mod, node.lineno))
                continue
            full = f"{mod}.{a.name}"
            self.uses.append((full, node.lineno))
            self.bound[a.asname or a.name] = full

    def visit_Attribute(self, node: ast.Attribute) -> None:
        chain: list[str] = []
        cur: ast.expr = node
        while isinstance(cur, ast.Attribute):
            chain.append(cur.attr)
            cur = cur.value
        if isinstance(cur, ast.Name) and cur.id in self.bound:
            self.uses.append((".".join([self.bound[cur.id], *reversed(chain)]), node.lineno))
            return  # the inner attributes are prefixes of this chain
        self.generic_visit(node)


def collect(root: Path) -> dict[str, list[str]]:
    """Every DeepSpeed name used under ``root`` -> the places (file:line) it is used."""
    where: dict[str, list[str]] = defaultdict(list)
    for path in sorted(root.rglob("*.py")):
        try:
            tree = ast.parse(path.read_text(errors="replace"))
        except SyntaxError:
            continue
        visitor = _Uses()
        visitor.visit(tree)
        for name, line in visitor.uses:
            where[name].append(f"{path.relative_to(root)}:{line}")
    return dict(where)


def resolve(names: list[str], switch: bool) -> dict[str, str | None]:
    """name -> None if it resolves, else the error (in a fresh interpreter)."""
    env = {k: v for k, v in os.environ.items() if k != "SLIPSTREAM_AS_DEEPSPEED"}
    env["DS_ACCELERATOR"] = "cpu"
    if switch:
        env["SLIPSTREAM_AS_DEEPSPEED"] = "1"
    proc = subprocess.run(
        [sys.executable, "-c", _RESOLVE],
        input=json.dumps(names),
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"resolver failed: {proc.stderr[-2000:]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkout", type=Path, help="a DeepSpeedExamples checkout")
    ap.add_argument("--deepspeed", action="store_true", help="also resolve on real DeepSpeed")
    ap.add_argument("--json", type=Path, default=None, help="write the full results here")
    args = ap.parse_args(argv)
    where = collect(args.checkout)
    names = sorted(where)
    ours = resolve(names, switch=True)
    theirs = resolve(names, switch=False) if args.deepspeed else {}
    uses = {n: len(where[n]) for n in names}

    def count(result: dict[str, str | None]) -> tuple[int, int]:
        ok = [n for n in names if n in result and result[n] is None]
        return len(ok), sum(uses[n] for n in ok)

    print(f"DeepSpeed names used: {len(names)} unique, {sum(uses.values())} uses")
    n_ok, u_ok = count(ours)
    print(f"resolve on slipstream: {n_ok} names, {u_ok} uses")
    if theirs:
        n_ok, u_ok = count(theirs)
        print(f"resolve on DeepSpeed:  {n_ok} names, {u_ok} uses")
    print("\nnot resolved on slipstream (uses, DeepSpeed resolves it?, first place, error):")
    for n in names:
        if ours[n] is not None:
            ds = "" if not theirs else ("ds:yes" if theirs[n] is None else "ds:no ")
            print(f"  {n:60s} {uses[n]:3d} {ds} {where[n][0]}  {ours[n][:90]}")
    if args.json:
        args.json.write_text(
            json.dumps({"where": where, "slipstream": ours, "deepspeed": theirs}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
