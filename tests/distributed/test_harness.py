"""The distributed test harness never lets a hung world block the suite."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from tests.distributed.harness import run_world


def _rank1_hangs() -> int:
    if dist.get_rank() == 1:
        time.sleep(600)
    return 0


def test_a_hung_world_is_killed_at_the_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="_rank1_hangs on 2 ranks did not finish within 4 s"):
        run_world(_rank1_hangs, 2, timeout_s=4)
    assert time.monotonic() - start < 30
