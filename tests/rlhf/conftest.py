"""The engine-level RLHF checks run in one 2-rank world (tests/rlhf/_hybrid_workloads.py);
the tests of this directory read its per-rank results.

Each test names the checks it reads with ``@pytest.mark.rlhf_checks(...)``, and the world runs
only the checks of the selected tests: one test (``pytest tests/rlhf/test_dpo.py``) runs only
its family, the whole directory runs every check once, in one world.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.distributed.harness import run_world


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "rlhf_checks(*names): checks of the 2-rank RLHF world (tests/rlhf/_hybrid_workloads.py"
        " checks()) the test reads",
    )


def wanted_checks(items: list[pytest.Item]) -> tuple[str, ...]:
    """The checks the selected tests that use the world name, sorted."""
    names = {
        name
        for item in items
        if "rlhf_world" in getattr(item, "fixturenames", ())
        for mark in item.iter_markers("rlhf_checks")
        for name in mark.args
    }
    return tuple(sorted(names))


@pytest.fixture(scope="session")
def rlhf_world(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    pytest.importorskip("transformers")
    from tests.rlhf import _hybrid_workloads as w

    names = wanted_checks(request.session.items)
    unknown = sorted(set(names) - set(w.checks()))
    if unknown:
        pytest.fail(f"rlhf_checks names unknown checks {unknown}; known: {sorted(w.checks())}")
    return run_world(w.run_checks, 2, names, timeout_s=300)
