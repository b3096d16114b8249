"""The Python examples in docs/evoformer.md run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "evoformer.md"
BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_doc_example_runs(index: int) -> None:
    """Each ```python block executes without error (its own asserts included)."""
    exec(compile(BLOCKS[index], f"{DOC.name}[{index}]", "exec"), {})
