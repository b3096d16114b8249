"""Run the science tests on one intra-op thread.

Their tensors are tiny; on a shared 2-core machine torch's OpenMP threads spin against other
work and tiny ops get 10-100x slower (a 25 s memory test instead of 1 s).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="package")
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
