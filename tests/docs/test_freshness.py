"""Docs that cannot rot: the architecture page's floors are the layering test's, every
``slipstream`` sub-command is documented, no page says "not yet" of a package that exists or
cites an internal issue number, and the home page's reading order links every page."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from slipstream.cli.main import build_parser
from tests.docs._blocks import ROOT
from tests.test_layering import FLOORS, PACKAGE

DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
TICKED = re.compile(r"`([^`]+)`")


def _section(path: Path, title: str) -> str:
    text = path.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def _floor_table() -> dict[int, set[str]]:
    """Floor number -> the units its row of docs/architecture.md names."""
    rows: dict[int, set[str]] = {}
    for line in _section(DOCS / "architecture.md", "The floors").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].isdigit():
            units = set(TICKED.findall(cells[1]))
            rows[int(cells[0])] = {"" if u == "slipstream/__init__.py" else u for u in units}
    return rows


def _exists(unit: str) -> bool:
    return (PACKAGE / unit / "__init__.py").is_file() or (PACKAGE / f"{unit}.py").is_file()


def test_architecture_table_has_every_floor() -> None:
    """Each unit of tests/test_layering.FLOORS sits on the same floor in the table; a unit the
    table names beyond them must not exist yet (a reserved floor)."""
    rows = _floor_table()
    assert sorted(rows) == list(range(len(FLOORS))), (
        f"docs/architecture.md's floor table has rows {sorted(rows)}; FLOORS has "
        f"{len(FLOORS)} floors (0-{len(FLOORS) - 1}): give each its row"
    )
    wrong = [
        f"{unit or 'slipstream/__init__.py'}: floor {i} in FLOORS, "
        f"{[n for n, r in rows.items() if unit in r] or 'absent'} in the table"
        for i, floor in enumerate(FLOORS)
        for unit in sorted(floor)
        if unit not in rows[i]
    ]
    assert not wrong, "docs/architecture.md's floor table disagrees with FLOORS:\n" + "\n".join(
        wrong
    )
    known = {u for floor in FLOORS for u in floor}
    stale = sorted(u for r in rows.values() for u in r - known if _exists(u))
    assert not stale, f"units in the table but not in FLOORS, and they exist: {stale}"


def _sub_commands() -> list[str]:
    parser = build_parser()
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sorted(actions[0].choices)


def test_every_sub_command_is_documented() -> None:
    """`slipstream NAME` appears in some page, and NAME in the architecture table's cli row."""
    commands = _sub_commands()
    assert {"run", "plan", "chat"} <= set(commands), commands
    text = "\n".join(p.read_text() for p in PAGES)
    undocumented = [c for c in commands if not re.search(rf"\bslipstream {c}\b", text)]
    assert not undocumented, f"sub-commands no docs page shows (`slipstream NAME`): {undocumented}"
    row_text = next(
        line
        for line in _section(DOCS / "architecture.md", "The floors").splitlines()
        if "| `cli` |" in line
    )
    missing = [c for c in commands if f"`{c}`" not in row_text]
    assert not missing, f"docs/architecture.md's cli row does not list: {missing}"


def _unit_of(token: str) -> str | None:
    """The top-level unit a ticked name denotes (``planner``, ``rlhf/``, ``slipstream.moe``)."""
    name = token.removeprefix("slipstream/").removeprefix("slipstream.").rstrip("/")
    return name if re.fullmatch(r"[a-z_]+", name) and _exists(name) else None


def test_no_page_says_not_yet_of_an_existing_package() -> None:
    stale = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()[:120]}"
        for path in [*PAGES, ROOT / "README.md"]
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if "not yet" in line.lower() and any(_unit_of(t) for t in TICKED.findall(line))
    ]
    assert not stale, "lines that say 'not yet' of a package that exists:\n" + "\n".join(stale)
    assert _unit_of("planner") == "planner" and _unit_of("rlhf/") == "rlhf"
    assert _unit_of("no_such_unit") is None and _unit_of("device: nvme") is None


def test_no_internal_issue_numbers() -> None:
    """The docs stand on their own: "issue 23" means nothing to a reader (upstream references
    such as deepspeedai/DeepSpeed#8068 are links, not this pattern)."""
    pattern = re.compile(r"\bissues? #?\d+", re.IGNORECASE)
    found = [
        f"{path.relative_to(ROOT)}:{n}: {m.group(0)}"
        for path in [*PAGES, ROOT / "README.md"]
        for n, line in enumerate(path.read_text().splitlines(), 1)
        for m in pattern.finditer(line)
    ]
    assert not found, "internal issue numbers in the docs:\n" + "\n".join(found)
    assert pattern.search("From issue 23, ...") and not pattern.search("DeepSpeed#8068")


def test_reading_order_links_every_page() -> None:
    order = _section(DOCS / "index.md", "Reading order")
    missing = [p.name for p in PAGES if p.name != "index.md" and f"]({p.name}" not in order]
    assert not missing, f"docs/index.md's reading order does not link: {missing}"
