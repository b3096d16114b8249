"""Find the runnable code blocks of the docs, and run one in a forked, warm process.

The markers (documented in docs/development.md) sit on the line right before a fence:

* ``<!-- no-test: reason -->``: the block is not run; the reason says why.
* ``<!-- test: nproc=N -->``: the block is a script for ``slipstream run --nproc N``; it runs on
  N ranks with the environment the launcher sets (RANK, WORLD_SIZE, MASTER_ADDR, ...).
* ``<!-- test: continues -->``: the block goes on from the previous python block of the same
  page; the test runs both, in order, as one script.

Importing torch takes seconds on a busy 2-core machine, so blocks do not start fresh
interpreters: a forkserver imports torch and slipstream once, and every rank of every block
is a process forked from it (its own memory, working directory and environment).
"""

from __future__ import annotations

import atexit
import os
import re
import runpy
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^(\s*)```(\w*)(.*)$")
MARKER = re.compile(r"^\s*<!--\s*(no-test|test)\s*:\s*(.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    """One ```python block: where it is, its code and how it runs."""

    path: Path
    line: int  # 1-based line of the opening fence
    code: str
    nproc: int = 1
    skip_reason: str | None = None
    continues: bool = False

    @property
    def id(self) -> str:
        name = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        return f"{name}:{self.line}"


def doc_files() -> list[Path]:
    """README.md and every page under docs/ (the site's pages)."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def parse_blocks(path: Path) -> list[Block]:
    """The python blocks of one markdown file, with their markers applied.

    Raises:
        ValueError: a marker that is not one of the documented forms (a typo must not
            silently turn a block off), or a ``continues`` block with no block before it.
    """
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, lang = match.group(1), match.group(2)
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        if lang == "python":
            body = [line.removeprefix(indent) for line in lines[i + 1 : end]]
            marker = lines[i - 1] if i > 0 else ""
            blocks.append(_with_marker(Block(path, i + 1, "\n".join(body) + "\n"), marker))
        i = end + 1
    for k, block in enumerate(blocks):
        if block.continues and k == 0:
            raise ValueError(f"{block.id}: 'test: continues' but no python block comes before it")
    return blocks


def _with_marker(block: Block, line: str) -> Block:
    match = MARKER.match(line)
    if match is None:
        if "no-test" in line or "<!-- test" in line:
            raise ValueError(f"{block.id}: malformed marker {line.strip()!r}")
        return block
    kind, arg = match.groups()
    if kind == "no-test":
        if not arg:
            raise ValueError(f"{block.id}: 'no-test' needs a reason: <!-- no-test: why -->")
        return Block(block.path, block.line, block.code, skip_reason=arg)
    nproc, continues = 1, False
    for item in filter(None, (s.strip() for s in arg.split(","))):
        if item == "continues":
            continues = True
        elif re.fullmatch(r"nproc=[1-8]", item):
            nproc = int(item.split("=")[1])
        else:
            raise ValueError(
                f"{block.id}: unknown test option {item!r} in {line.strip()!r}; "
                "use 'nproc=N' and/or 'continues'"
            )
    return Block(block.path, block.line, block.code, nproc=nproc, continues=continues)


def script_for(blocks: list[Block], k: int) -> str:
    """Block ``k``'s code, preceded by the blocks it continues."""
    start = k
    while blocks[start].continues:
        start -= 1
    return "\n".join(b.code for b in blocks[start : k + 1])


def run_rank(script: str, cwd: str, env: dict[str, str], log: str) -> None:
    """Entry of one forked rank: run ``script`` as ``__main__`` in ``cwd``, output to ``log``.

    Exits with the script's status (1 on an exception, with its traceback in the log). The
    interpreter's exit handlers run first, as at a normal exit (monitors flush there).
    """
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = [script]
    import torch

    torch.set_num_threads(1)  # ranks share 2 cores with other work
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
        code = code or 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
