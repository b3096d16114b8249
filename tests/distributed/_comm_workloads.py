"""Rank-side checks of the communication layer."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from slipstream.distributed import comm
from slipstream.distributed.mesh import ParallelDims, build_mesh, dp_group


def collectives() -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = build_mesh(ParallelDims(world_size=world))
    group = dp_group(mesh)
    comm.comm_counters.reset()
    out: dict[str, Any] = {}
    x = torch.arange(8 * world, dtype=torch.float32) + 100 * rank
    expected_sum = sum(torch.arange(8 * world, dtype=torch.float32) + 100 * r for r in range(world))
    shard = torch.empty(8)
    comm.reduce_scatter_tensor(shard, x, group=group)
    out["rs_sync"] = torch.equal(shard, expected_sum[rank * 8 : (rank + 1) * 8])
    shard2 = torch.empty(8)
    work = comm.reduce_scatter_tensor(shard2, x, group=group, async_op=True)
    work.wait()
    work.wait()  # idempotent
    out["rs_async"] = torch.equal(shard2, shard)
    full = torch.full((8 * world,), -1.0)
    full[rank * 8 : (rank + 1) * 8] = rank + 1.0
    comm.all_gather_into_tensor(full, full[rank * 8 : (rank + 1) * 8], group=group)  # in place
    out["ag_inplace"] = torch.equal(full, torch.repeat_interleave(torch.arange(1.0, world + 1), 8))
    other = torch.empty(8 * world, dtype=torch.bfloat16)
    work = comm.all_gather_into_tensor(
        other, torch.full((8,), rank + 0.5, dtype=torch.bfloat16), group=group, async_op=True
    )
    work.wait()
    out["ag_bf16"] = torch.equal(
        other.float(), torch.repeat_interleave(torch.arange(world) + 0.5, 8)
    )
    y = x.clone()
    comm.all_reduce(y, group=group)
    out["ar"] = torch.equal(y, expected_sum)
    a2a = torch.empty_like(x)
    comm.all_to_all_single(a2a, x, group=group)
    out["a2a"] = torch.equal(a2a.view(world, 8)[0], x.new_tensor(range(rank * 8, rank * 8 + 8)))
    out["summary"] = comm.log_summary()
    out["seconds"] = {op: e.seconds for (_, op), e in comm.comm_counters.stats.items()}
    out["table"] = comm.summary_table(step_seconds=10.0)
    # Work issued but never waited on reports no time (it has not completed as far as we know).
    comm.comm_counters.reset()
    comm.all_reduce(y.clone(), group=group, async_op=True)
    out["unwaited"] = {op: e.seconds for (_, op), e in comm.comm_counters.stats.items()}
    comm.barrier(group=group)
    try:
        comm.check_same_across_ranks(("shape", rank % 2), "model")
        out["diverged"] = None
    except RuntimeError as e:
        out["diverged"] = str(e)
    # Issue 38: a long parameter list differing near its end names that parameter.
    params = [(f"layers.{i}.weight", (64, 64), "torch.float32") for i in range(100)]
    params[90] = ("layers.90.weight", (64, 64 + rank), "torch.float32")
    try:
        comm.check_same_across_ranks(params, "model (parameter names, shapes and dtypes)")
        out["diverged_late"] = None
    except RuntimeError as e:
        out["diverged_late"] = str(e)
    return out


def flags_and_groups() -> dict[str, Any]:
    """all_true / any_true over the world and a sub-group; the mesh's group helpers."""
    from slipstream.distributed.mesh import consecutive_group, member_group

    rank, world = dist.get_rank(), dist.get_world_size()
    comm.comm_counters.reset()
    pair = consecutive_group(2, axis="tp")  # [0, 1], [2, 3]
    out: dict[str, Any] = {
        "pair": comm.get_world_size(pair),
        "pair_axis": comm.axis_name(pair),
        "whole_world": consecutive_group(world, axis="tp") is None,
        "all_world": comm.all_true(rank != 3, label="flag"),
        "any_world": comm.any_true(rank == 3, label="flag"),
        "none_world": comm.any_true(False, label="flag"),
        "every_world": comm.all_true(True, label="flag"),
        # Ranks 2 and 3 share a group: only theirs sees rank 3's flag.
        "all_pair": comm.all_true(rank != 3, group=pair, label="flag"),
        "any_pair": comm.any_true(rank == 3, group=pair, label="flag"),
    }
    out["flag_bytes"] = sum(
        ops.get("all_reduce", {}).get("bytes", 0) for ops in comm.log_summary().values()
    )
    found = member_group([[0, 2], [1, 3]], axis="pp")
    assert found is not None
    group, ranks = found
    members = torch.tensor([float(rank)])
    comm.all_reduce(members, group=group)
    out["column"] = (ranks, members.item())
    return out
