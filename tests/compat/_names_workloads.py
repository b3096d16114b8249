"""Rank side of tests/compat/test_names.py: ``deepspeed.comm.TorchBackend``'s collectives
on 2 gloo ranks, as DeepSpeedExamples' communication benchmark calls them."""

from __future__ import annotations

import torch
import torch.distributed as dist

from slipstream import comm as ds_comm
from slipstream.comm import TorchBackend, comm_counters


def torch_backend_collectives() -> dict[str, list[float]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    before = sum(comm_counters.bytes_by_axis().values())
    gather = TorchBackend.get_all_gather_function()
    out = torch.zeros(2 * world)
    gather(out, torch.full((2,), float(rank + 1)), group=None, async_op=False)
    scatter = TorchBackend.get_reduce_scatter_function()
    part = torch.zeros(2)
    scatter(part, torch.arange(2.0 * world) + rank)
    after = sum(comm_counters.bytes_by_axis().values())
    return {
        "gathered": out.tolist(),
        "scattered": part.tolist(),
        "counted": [float(after - before)],
    }


def point_to_point() -> dict[str, list[float]]:
    """DeepSpeedExamples' pt2pt benchmark calls: rank 0 sends, rank 1 receives."""
    rank = dist.get_rank()
    t = torch.full((3,), 5.0) if rank == 0 else torch.zeros(3)
    if rank == 0:
        ds_comm.send(t, 1)
        ds_comm.isend(t * 2, 1).wait()
    else:
        ds_comm.recv(t, 0)
        u = torch.zeros(3)
        ds_comm.irecv(u, 0).wait()
        t = torch.cat([t, u])
    out = torch.zeros(2 * 2)
    ds_comm.allgather_fn(out, torch.full((2,), float(rank)))
    return {"got": t.tolist(), "gathered": out.tolist()}
