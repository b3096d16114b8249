"""Expert-parallel workloads: a small MoE model on 2 gloo ranks (ep_size 2) against the same
model in one process (ep_size 1, every expert local), fed each rank's batch in turn.

The gate is set so that routing is uneven across ranks and expert 3 receives no token: inputs
are positive and the gate row of expert 3 negative, and the two ranks' inputs weight
different features.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from slipstream.distributed.comm import get_world_size as comm_size
from slipstream.moe import MoE, clip_grad_norm_, expert_parallel_, reduce_gradients_

DIM, EXPERTS, TOKENS, STEPS, LR = 8, 4, 12, 3, 0.05


class Net(nn.Module):
    def __init__(self, ep_size: int, k: int) -> None:
        super().__init__()
        expert = nn.Sequential(nn.Linear(DIM, 16), nn.GELU(), nn.Linear(16, DIM))
        self.moe = MoE(
            DIM,
            expert,
            num_experts=EXPERTS,
            ep_size=ep_size,
            k=k,
            drop_tokens=False,
            use_rts=False,
            top2_2nd_expert_sampling=False,
        )
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h, l_aux, _ = self.moe(x)
        return ((self.head(h) - y) ** 2).mean() + 0.01 * l_aux


def reference(k: int) -> Net:
    torch.manual_seed(0)
    net = Net(1, k)
    with torch.no_grad():
        wg = net.moe.deepspeed_moe.gate.wg.weight
        wg.abs_()
        wg[3] = -wg[3]
    return net


def local_copy(ref: Net, ep_size: int, ep_rank: int, k: int) -> Net:
    """The ep_size model of expert-parallel rank ``ep_rank``, with ``ref``'s weights."""
    net = Net(ep_size, k)
    local = EXPERTS // ep_size
    state = {}
    for name, t in ref.state_dict().items():
        prefix = "moe.deepspeed_moe.experts.deepspeed_experts."
        if name.startswith(prefix):
            gid, rest = name[len(prefix) :].split(".", 1)
            lid = int(gid) - ep_rank * local
            if 0 <= lid < local:
                state[f"{prefix}{lid}.{rest}"] = t.clone()
        else:
            state[name] = t.clone()
    net.load_state_dict(state)
    return net


def batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    scale = torch.linspace(0.2, 2.0, DIM) if rank == 0 else torch.linspace(2.0, 0.2, DIM)
    return [
        (torch.rand(TOKENS, DIM, generator=g) * scale + 0.05, torch.randn(TOKENS, DIM, generator=g))
        for _ in range(STEPS)
    ]


def _expert_view(ref_grads: dict[str, torch.Tensor], ep_rank: int, ep_size: int) -> dict:
    """``ref_grads`` renamed to the local expert ids of ``ep_rank`` (others left out)."""
    prefix = "moe.deepspeed_moe.experts.deepspeed_experts."
    local = EXPERTS // ep_size
    out = {}
    for name, t in ref_grads.items():
        if name.startswith(prefix):
            gid, rest = name[len(prefix) :].split(".", 1)
            lid = int(gid) - ep_rank * local
            if 0 <= lid < local:
                out[f"{prefix}{lid}.{rest}"] = t
        else:
            out[name] = t
    return out


def reference_run(k: int, world: int, clip: float) -> dict[str, Any]:
    """One process: each step averages the ranks' losses (what data parallelism computes)."""
    net = reference(k)
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
    data = [batches(r) for r in range(world)]
    out: dict[str, Any] = {"outs": [], "grads": [], "norms": [], "counts": []}
    for step in range(STEPS):
        loss = sum(net(*data[r][step]) for r in range(world)) / world
        loss.backward()  # type: ignore[union-attr]
        with torch.no_grad():
            out["outs"].append([net.moe(data[r][step][0])[0] for r in range(world)])
        out["counts"].append(net.moe.deepspeed_moe.exp_counts.clone())
        out["grads"].append({n: p.grad.clone() for n, p in net.named_parameters()})
        out["norms"].append(float(nn.utils.clip_grad_norm_(net.parameters(), clip or 1e9)))
        opt.step()
        opt.zero_grad()
    out["params"] = {n: p.detach().clone() for n, p in net.named_parameters()}
    return out


def manual_ep(k: int, clip: float) -> dict[str, Any]:
    """ep_size 2 on 2 ranks with the plan's gradient reduction and clipping, plain SGD."""
    rank, world = dist.get_rank(), dist.get_world_size()
    net = local_copy(reference(k), world, rank, k)
    groups = expert_parallel_(net, None)
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
    data = batches(rank)
    res: dict[str, Any] = {"outs": [], "grads": [], "norms": [], "counts": []}
    for step in range(STEPS):
        x, y = data[step]
        net(x, y).backward()
        with torch.no_grad():
            res["outs"].append(net.moe(x)[0])
        res["counts"].append(net.moe.deepspeed_moe.exp_counts.clone())
        reduce_gradients_(net, None, groups)
        res["grads"].append({n: p.grad.clone() for n, p in net.named_parameters()})
        res["norms"].append(clip_grad_norm_(net, clip or 1e9, None, groups))
        opt.step()
        opt.zero_grad()
    res["params"] = {n: p.detach().clone() for n, p in net.named_parameters()}
    res["reference"] = reference_run(k, world, clip)
    res["reference_view"] = {
        "grads": [_expert_view(g, rank, world) for g in res["reference"]["grads"]],
        "params": _expert_view(res["reference"]["params"], rank, world),
    }
    return res


def engine_ep(stage: int, bf16: bool, clip: float, k: int = 2) -> dict[str, Any]:
    """slipstream.initialize with ep_size 2 (and, to compare, ep_size 1) on 2 ranks."""
    import slipstream

    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    for ep in (1, world):
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 200},
            "bf16": {"enabled": bf16},
            "gradient_clipping": clip,
        }
        net = local_copy(reference(k), ep, rank % ep, k)
        engine, _, _, _ = slipstream.initialize(
            model=net, model_parameters=net.parameters(), config=config
        )
        losses = []
        for x, y in batches(rank):
            dt = torch.bfloat16 if bf16 else torch.float32
            loss = engine(x.to(dt), y.to(dt))
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
        with slipstream.zero.GatheredParameters(list(engine.module.parameters())):
            params = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
        buckets = engine.optimizer.buckets
        out[ep] = {
            "losses": losses,
            "params": params,
            "expert_buckets": [
                comm_size(b.expert.edp_group) for b in buckets if b.expert is not None
            ],
        }
        engine.destroy()
    out["reference"] = _expert_view(reference_run(k, world, clip)["params"], rank, world)
    return out


class DroplessNet(nn.Module):
    def __init__(self, ep_size: int) -> None:
        super().__init__()
        from slipstream.moe import DroplessMoE, RouterConfig

        self.moe = DroplessMoE(DIM, 16, EXPERTS, ep_size, RouterConfig(k=2, z_loss_coef=1e-3))
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h, loss, _ = self.moe(x)
        return ((self.head(h) - y) ** 2).mean() + loss


def _dropless_reference() -> DroplessNet:
    torch.manual_seed(0)
    net = DroplessNet(1)
    with torch.no_grad():
        wg = net.moe.router.gate.weight
        wg.abs_()
        wg[3] = -wg[3]
    return net


def dropless_ep() -> dict[str, Any]:
    """DroplessMoE ep_size 2 on 2 ranks vs one process; plain SGD, 3 steps."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = _dropless_reference()
    net = DroplessNet(world)
    local = EXPERTS // world
    state = ref.state_dict()
    for key in ("moe.experts.w1", "moe.experts.w2"):
        state[key] = state[key][rank * local : (rank + 1) * local].clone()
    net.load_state_dict(state)
    groups = expert_parallel_(net, None)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    data = [batches(r) for r in range(world)]
    res: dict[str, Any] = {"outs": [], "ref_outs": []}
    for step in range(STEPS):
        x, y = data[rank][step]
        net(x, y).backward()
        reduce_gradients_(net, None, groups)
        opt.step()
        opt.zero_grad()
        (sum(ref(*data[r][step]) for r in range(world)) / world).backward()  # type: ignore[union-attr]
        ref_opt.step()
        ref_opt.zero_grad()
        with torch.no_grad():
            res["outs"].append(net.moe(x)[0])
            res["ref_outs"].append(ref.moe(x)[0])
            res["counts"] = ref.moe(torch.cat([data[r][step][0] for r in range(world)]))[2]
    res["params"] = {n: p.detach().clone() for n, p in net.named_parameters()}
    ref_params = {n: p.detach().clone() for n, p in ref.named_parameters()}
    for key in ("moe.experts.w1", "moe.experts.w2"):
        ref_params[key] = ref_params[key][rank * local : (rank + 1) * local]
    res["ref_params"] = ref_params
    return res
