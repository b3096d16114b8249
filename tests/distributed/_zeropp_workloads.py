"""Rank-side checks of the ZeRO++ collectives."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from slipstream.distributed import comm, quantized_comm
from slipstream.distributed.topology import build_node_topology


def two_hop(ranks_per_node: int) -> dict[int, dict[str, Any]]:
    return {bits: _two_hop(ranks_per_node, bits) for bits in (8, 4)}


def _two_hop(ranks_per_node: int, bits: int) -> dict[str, Any]:
    os.environ["SLIPSTREAM_RANKS_PER_NODE"] = str(ranks_per_node)
    topo = build_node_topology()  # (a second call makes a second, equal set of groups)
    world, rank = dist.get_world_size(), dist.get_rank()
    chunk = 96
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(world * chunk, generator=g)
    ref = torch.empty(chunk)
    comm.reduce_scatter_tensor(ref, x.clone())
    out = torch.empty(chunk)
    comm.comm_counters.reset()
    quantized_comm.reduce_scatter_2hop_quantized(
        out, x, topo.node_group, topo.cross_group, bits=bits, block=32
    )
    every = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(every, x)
    exact = torch.stack(every).sum(0)[rank * chunk : (rank + 1) * chunk]
    return {
        "ref": ref,
        "out": out,
        "exact": exact,
        "cross": comm.comm_counters.cross_node_bytes(),
        "absmax": torch.stack(every).abs().max().item(),
    }


def qwz_gather(ranks_per_node: int) -> dict[str, Any]:
    os.environ["SLIPSTREAM_RANKS_PER_NODE"] = str(ranks_per_node)
    build_node_topology()
    world, rank = dist.get_world_size(), dist.get_rank()
    shard = torch.randn(320, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
    full = torch.empty(320 * world, dtype=torch.bfloat16)
    comm.comm_counters.reset()
    work = quantized_comm.all_gather_quantized(full, shard, bits=8, block=64, async_op=True)
    work.wait()
    q_cross = comm.comm_counters.cross_node_bytes()
    exact = torch.empty_like(full)
    comm.comm_counters.reset()
    comm.all_gather_into_tensor(exact, shard)
    return {
        "full": full,
        "exact": exact,
        "q_cross": q_cross,
        "cross": comm.comm_counters.cross_node_bytes(),
    }
