"""The README's links resolve, and the site's home page repeats its feature table and status."""

from __future__ import annotations

import re
from pathlib import Path

from markdown.extensions.toc import slugify

from tests.docs._blocks import ROOT

LINK = re.compile(r"\]\(([^)\s]+)\)")


def _headings(path: Path) -> set[str]:
    """The anchors mkdocs gives the headings of ``path`` (fenced code skipped)."""
    anchors, fenced = set(), False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} (.+)", line)):
            anchors.add(slugify(m.group(1).replace("`", ""), "-"))
    return anchors


def test_readme_links_resolve() -> None:
    """The README is not part of the site, so mkdocs does not check its links: this does."""
    links = [t for t in LINK.findall((ROOT / "README.md").read_text()) if "://" not in t]
    assert len(links) >= 15, f"the README links only {links} into docs/"
    broken = []
    for link in links:
        target, _, anchor = link.partition("#")
        path = ROOT / target
        if not path.exists() or (anchor and anchor not in _headings(path)):
            broken.append(link)
    assert not broken, f"README links to missing files or headings: {broken}"


def _section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)].rstrip()


def test_home_page_repeats_the_readme() -> None:
    readme = (ROOT / "README.md").read_text().replace("](docs/", "](")
    index = (ROOT / "docs" / "index.md").read_text()
    for title in ("Features", "Status"):
        assert _section(index, title) == _section(readme, title), (
            f"docs/index.md's '{title}' differs from the README's: copy it over (links "
            "without the docs/ prefix)"
        )
