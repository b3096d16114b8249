"""Rules for the source tree that keep it navigable: no module over 600 lines (split by job
instead), and no user-facing text that cites the project's internal issue numbers (a user
cannot look them up; say what to do instead)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "slipstream"
MAX_LINES = 600
ISSUE_NUMBER = re.compile(r"\bissues? #?\d+", re.IGNORECASE)


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_no_module_over_600_lines() -> None:
    long = {
        str(p.relative_to(PACKAGE.parent)): n
        for p in _modules()
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines (split them by job): {long}"


def _strings(tree: ast.AST) -> list[tuple[int, str]]:
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    ]


def test_no_internal_issue_numbers_in_text() -> None:
    found = [
        f"{p.relative_to(PACKAGE.parent)}:{line}: {ISSUE_NUMBER.search(text)[0]!r}"  # type: ignore[index]
        for p in _modules()
        for line, text in _strings(ast.parse(p.read_text()))
        if ISSUE_NUMBER.search(text)
    ]
    assert not found, "text citing internal issue numbers:\n" + "\n".join(found)


def test_the_rules_can_fail() -> None:
    assert ISSUE_NUMBER.search("arrives with issue 3")
    assert _strings(ast.parse('x = "see issue #12"')) == [(1, "see issue #12")]
