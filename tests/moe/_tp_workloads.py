"""Expert parallelism composed with tensor parallelism, and 4-rank expert splitting, against
one process on the same global batch.

The model is one block (a dense MLP the automatic TP plan splits, then an MoE layer) and a
head. In the world of 4 gloo ranks:

- ``tp 2 x ep 2`` (dp 2): the experts of one TP rank are spread over the two data-parallel
  ranks; with ``enable_expert_tensor_parallelism`` False they are whole on both TP ranks (each
  computes half of the rows, gradients summed over TP), with it True they are split
  column/row-wise like the dense MLP;
- ``ep 2, edp 2`` (dp 4, tp 1): 4 experts, two ranks per expert group, at ZeRO-2.
- ``pp 2 x dp 2``: a ``PipelineModule`` whose first stage holds an ``ep_size`` 2 layer.

Each compares the losses, the global gradient norm (clipping is on and takes effect) and the
parameters after 3 SGD steps with one process stepping on the mean of the shards' losses.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import slipstream
from slipstream.distributed.comm import get_world_size as comm_size
from slipstream.distributed.placement import tp_shard
from slipstream.moe import MoE
from slipstream.parallel.tensor import tp_slice

DIM, HIDDEN, EXPERTS, TOKENS, STEPS, LR, CLIP = 8, 16, 4, 12, 3, 0.05, 0.1
PREFIX = "blocks.0.moe.deepspeed_moe.experts.deepspeed_experts."


class Block(nn.Module):
    def __init__(self, ep_size: int, expert_tp: bool) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, DIM))
        expert = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, DIM))
        self.moe = MoE(
            DIM,
            expert,
            num_experts=EXPERTS,
            ep_size=ep_size,
            k=2,
            drop_tokens=False,
            use_rts=False,
            top2_2nd_expert_sampling=False,
            enable_expert_tensor_parallelism=expert_tp,
        )


class Net(nn.Module):
    def __init__(self, ep_size: int = 1, expert_tp: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(ep_size, expert_tp)])
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        block = self.blocks[0]
        h = x + block.mlp(x)
        m, l_aux, _ = block.moe(h)
        return ((self.head(h + m) - y) ** 2).mean() + 0.01 * l_aux


def reference() -> Net:
    torch.manual_seed(0)
    return Net()


def _global(name: str, ep_rank: int, ep_size: int) -> str | None:
    """The one-process name of local parameter ``name`` (None: another rank's expert)."""
    if not name.startswith(PREFIX):
        return name
    lid, rest = name[len(PREFIX) :].split(".", 1)
    return f"{PREFIX}{int(lid) + ep_rank * (EXPERTS // ep_size)}.{rest}"


def local_copy(ref: Net, ep_size: int, ep_rank: int, expert_tp: bool) -> Net:
    """The ``ep_size`` model of expert-parallel rank ``ep_rank`` with ``ref``'s weights."""
    net = Net(ep_size, expert_tp)
    full = ref.state_dict()
    net.load_state_dict(
        {n: full[str(_global(n, ep_rank, ep_size))].clone() for n in net.state_dict()}
    )
    return net


def batches(shard: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + shard)
    scale = torch.linspace(0.2, 2.0, DIM).roll(3 * shard)
    return [
        (torch.rand(TOKENS, DIM, generator=g) * scale, torch.randn(TOKENS, DIM, generator=g))
        for _ in range(STEPS)
    ]


def reference_run(shards: int) -> dict[str, Any]:
    """One process: each step averages the shards' losses (what data parallelism computes)."""
    net = reference()
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
    data = [batches(s) for s in range(shards)]
    out: dict[str, Any] = {"losses": [], "norms": []}
    for step in range(STEPS):
        losses = [net(*data[s][step]) for s in range(shards)]
        (sum(losses) / shards).backward()  # type: ignore[operator]
        out["losses"].append([float(v) for v in losses])
        out["norms"].append(float(nn.utils.clip_grad_norm_(net.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
    out["params"] = {n: p.detach().clone() for n, p in net.named_parameters()}
    return out


def _config(stage: int, tp: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 300},
        "gradient_clipping": CLIP,
        "tensor_parallel": {"autotp_size": tp},
    }


def _params(engine: Any, ep_rank: int, ep_size: int) -> dict[str, tuple[torch.Tensor, Any]]:
    """This rank's parameters by one-process name, with their TP slice record."""
    with slipstream.zero.GatheredParameters(list(engine.module.parameters())):
        return {
            str(_global(n, ep_rank, ep_size)): (p.detach().clone(), tp_shard(p))
            for n, p in engine.module.named_parameters()
        }


def _train(tp: int, ep: int, expert_tp: bool, stage: int, ckpt: str | None) -> dict[str, Any]:
    rank = dist.get_rank()
    dp_rank, ep_rank = rank // tp, (rank // tp) % ep
    net = local_copy(reference(), ep, ep_rank, expert_tp)
    engine, _, _, _ = slipstream.initialize(
        model=net, model_parameters=net.parameters(), config=_config(stage, tp)
    )
    res: dict[str, Any] = {"losses": [], "norms": [], "dp_rank": dp_rank}
    for x, y in batches(dp_rank):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        res["losses"].append(float(loss))
        res["norms"].append(engine.get_global_grad_norm())
    res["params"] = _params(engine, ep_rank, ep)
    res["expert_split"] = any(
        tp_shard(p) is not None for n, p in engine.module.named_parameters() if PREFIX in n
    )
    exchange = engine.module.blocks[0].moe.deepspeed_moe.exchange
    res["exchange"] = getattr(exchange, "__name__", type(exchange).__name__)
    res["edp"] = sorted(
        {comm_size(b.expert.edp_group) for b in engine.optimizer.buckets if b.expert is not None}
    )
    if ckpt is not None:
        engine.save_checkpoint(ckpt, tag="t")
    engine.destroy()
    return res


def _reload(ckpt: str, expert_tp: bool, tp: int = 2) -> dict[str, Any]:
    """The tp 2 x ep 2 checkpoint into a tp ``tp`` x ep 1 engine: every expert on every rank
    (at tp 1 the experts' TP slices, with expert TP, are joined from the saved layout)."""
    net = Net(1, expert_tp and tp > 1)
    engine, _, _, _ = slipstream.initialize(
        model=net, model_parameters=net.parameters(), config=_config(1, tp)
    )
    engine.load_checkpoint(ckpt, tag="t")
    params = _params(engine, 0, 1)
    engine.destroy()
    return params


def _error(fn: Any) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return ""


def refusals() -> dict[str, str]:
    """What is refused, by message: sequence parallelism with ep > 1; expert TP asked for
    but the experts left whole; a dropless layer under tensor parallelism."""
    from slipstream.distributed.expert import expert_groups
    from slipstream.distributed.mesh import ParallelDims, build_mesh
    from slipstream.moe import DroplessMoE, expert_parallel_

    tp_mesh = build_mesh(ParallelDims(world_size=4, tp=2))
    sp_mesh = build_mesh(ParallelDims(world_size=4, sp=2))
    dropless = nn.Sequential(DroplessMoE(DIM, HIDDEN, EXPERTS, 2))
    return {
        "sp": _error(lambda: expert_groups(sp_mesh, 2)),
        "unsplit": _error(lambda: expert_parallel_(Net(2, True), tp_mesh)),
        "dropless": _error(lambda: expert_parallel_(dropless, tp_mesh)),
    }


def world(tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {"ref_tp": reference_run(2), "ref_edp": reference_run(4)}
    out["refusals"] = refusals()
    for expert_tp in (False, True):
        ckpt = f"{tmp}/tp_ep_{expert_tp}"
        # ZeRO-0 with split experts: their TP shards' squares summed over TP at stage 0 too.
        out[f"tp2_ep2_{expert_tp}"] = _train(2, 2, expert_tp, 0 if expert_tp else 1, ckpt)
        dist.barrier()
        out[f"reload_{expert_tp}"] = _reload(ckpt, expert_tp)
        out[f"reload_tp1_{expert_tp}"] = _reload(ckpt, expert_tp, tp=1)
    out["ep2_edp2"] = _train(1, 2, False, 2, None)
    return out


def expected(ref: dict[str, torch.Tensor], name: str, shard: Any) -> torch.Tensor:
    """The one-process tensor ``name``, cut to ``shard`` when this rank holds a TP slice."""
    full = ref[name]
    return full if shard is None else tp_slice(full, shard)
