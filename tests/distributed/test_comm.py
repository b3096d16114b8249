"""The communication layer: gloo fast paths give exact results; bytes are counted per axis."""

from __future__ import annotations

import os

from tests.distributed import _comm_workloads as w
from tests.distributed.harness import run_fresh, run_world


def test_collectives_exact_and_counted():
    results = run_world(w.collectives, 2)
    for rank, r in enumerate(results):
        for key in ("rs_sync", "rs_async", "ag_inplace", "ag_bf16", "ar", "a2a"):
            assert r[key], key
        dp = r["summary"]["dp"]
        assert dp["reduce_scatter"] == {"calls": 2, "bytes": 2 * 16 * 4}
        assert dp["all_gather"] == {"calls": 2, "bytes": 16 * 4 + 16 * 2}
        assert dp["all_reduce"] == {"calls": 1, "bytes": 16 * 4}
        # Every completed collective, synchronous or waited on, has its time counted.
        assert all(r["seconds"][op] > 0 for op in ("reduce_scatter", "all_gather", "all_reduce"))
        assert r["unwaited"]["all_reduce"] == 0.0
        header, *rows = r["table"].splitlines()
        assert header.split()[-3:] == ["ms", "GB/s", "share"]
        assert any(row.split()[:2] == ["dp", "all_reduce"] and row.endswith("%") for row in rows)
        assert "model differs between ranks" in r["diverged"]
        assert "ranks [0]" in r["diverged"] and "ranks [1]" in r["diverged"]
        me, other = rank, 1 - rank
        assert (
            f"the first difference is item 90: this rank ({me}) has ('layers.90.weight', "
            f"(64, {64 + me}), 'torch.float32'), rank {other} has ('layers.90.weight', "
            f"(64, {64 + other})"
        ) in r["diverged_late"], r["diverged_late"]


def _init_a_world_of_one() -> bool:
    from slipstream.distributed import comm

    comm.init_distributed()
    assert comm.get_world_size() == 1
    return "MASTER_PORT" in os.environ


def test_world_of_one_leaves_no_master_port_for_child_processes():
    """A single-process init must not export MASTER_PORT: processes launched afterwards would
    inherit it and collide with this live rendezvous (EADDRINUSE). (A fresh process forked
    warm: tests before this one may have set up a process group here.)"""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "RANK", "WORLD_SIZE")}
    out = run_fresh(_init_a_world_of_one, env=env, timeout_s=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.result is False


def test_flags_and_the_mesh_group_helpers():
    """comm.all_true / any_true agree across the ranks of the world or of a sub-group (4 bytes
    each); consecutive_group gives consecutive ranks (None for the whole world);
    member_group returns this rank's group and its ranks."""
    results = run_world(w.flags_and_groups, 4)
    for rank, r in enumerate(results):
        assert r["pair"] == 2 and r["pair_axis"] == "tp" and r["whole_world"]
        assert r["all_world"] is False and r["any_world"] is True
        assert r["none_world"] is False and r["every_world"] is True
        assert r["all_pair"] is (rank < 2) and r["any_pair"] is (rank >= 2)
        assert r["flag_bytes"] == 6 * 4
        ranks = [rank % 2, rank % 2 + 2]
        assert r["column"] == (ranks, float(sum(ranks)))
