"""The communication layer: gloo fast paths give exact results; bytes are counted per axis."""

from __future__ import annotations

from tests.distributed import _comm_workloads as w
from tests.distributed.harness import run_world


def test_collectives_exact_and_counted():
    results = run_world(w.collectives, 2)
    for r in results:
        for key in ("rs_sync", "rs_async", "ag_inplace", "ag_bf16", "ar", "a2a"):
            assert r[key], key
        dp = r["summary"]["dp"]
        assert dp["reduce_scatter"] == {"calls": 2, "bytes": 2 * 16 * 4}
        assert dp["all_gather"] == {"calls": 2, "bytes": 16 * 4 + 16 * 2}
        assert dp["all_reduce"] == {"calls": 1, "bytes": 16 * 4}
        assert "model differs between ranks" in r["diverged"]
        assert "ranks [0]" in r["diverged"] and "ranks [1]" in r["diverged"]
