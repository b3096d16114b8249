"""One 2-rank world runs every engine-level RLHF check (tests/rlhf/_hybrid_workloads.py);
the tests of this directory read its per-rank results."""

from __future__ import annotations

from typing import Any

import pytest

from tests.distributed.harness import run_world


@pytest.fixture(scope="session")
def rlhf_world() -> list[dict[str, Any]]:
    pytest.importorskip("transformers")
    from tests.rlhf import _hybrid_workloads as w

    return run_world(w.all_checks, 2, timeout_s=300)
