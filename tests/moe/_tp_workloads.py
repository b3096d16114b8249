"""Expert parallelism composed with tensor parallelism, and 4-rank expert splitting, against
one process on the same global batch.

The model is one block (a dense MLP the automatic TP plan splits, then an MoE layer) and a
head. In the world of 4 gloo ranks:

- ``tp 2 x ep 2`` (dp 2): the experts of one TP rank are spread over the two data-parallel
  ranks; with ``enable_expert_tensor_parallelism`` False they are whole on both TP ranks (each
  computes half of the rows, gradients summed over TP), with it True they are split
  column/row-wise like the dense MLP; both at ZeRO-3 too, and the replicated layout at
  ZeRO-2 in bf16;
- ``tp 2 x ep 2`` with a ``DroplessMoE`` layer and with an AutoEP block (stacked experts,
  whole on both TP ranks, each computing half of every expert's rows);
- ``ep 2, edp 2`` (dp 4, tp 1): 4 experts, two ranks per expert group, at ZeRO-2.
- ``pp 2 x dp 2``: a ``PipelineModule`` whose first stage holds an ``ep_size`` 2 layer;
- ``sp 2 x dp 2`` with ``ep 2``: the reference GPT (Ulysses attention, one ``MoE`` block) whose
  expert groups are cut from the flattened data x sequence-parallel ranks (the sequence
  shards of one row exchange tokens), against one process on the whole batch (losses, every
  step's gradients, parameters; ZeRO-0 and ZeRO-2, clipping); its checkpoint loads at ep 1.

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
from slipstream.distributed.placement import TPShard, set_tp_shard_, tp_shard
from slipstream.moe import MoE
from slipstream.parallel.tensor import tp_slice

DIM, HIDDEN, EXPERTS, TOKENS, STEPS, LR, CLIP = 8, 16, 4, 12, 3, 0.05, 0.1
PREFIX = "blocks.0.moe.deepspeed_moe.experts.deepspeed_experts."
DROPLESS_PREFIX = "blocks.0.moe.experts."  # stacked: local expert i is dim 0 index i


class AutoEPBlock(nn.Module):
    """A converted Hugging Face MoE block in small: a top-2 softmax router (renormalised
    weights) and ``AutoEPExperts`` (SwiGLU, stacked ``gate_up_proj`` / ``down_proj``)."""

    def __init__(self, ep_size: int) -> None:
        super().__init__()
        from slipstream.moe.autoep import AutoEPExperts

        self.gate = nn.Linear(DIM, EXPERTS, bias=False)
        gate_up = torch.randn(EXPERTS, 2 * HIDDEN, DIM) * DIM**-0.5
        down = torch.randn(EXPERTS, DIM, HIDDEN) * HIDDEN**-0.5
        # Every rank keeps its slice of expert-parallel rank 0's; local_copy loads its own.
        self.experts = AutoEPExperts(gate_up, down, nn.functional.silu, EXPERTS, ep_size, 0)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        weights, idx = self.gate(h).softmax(-1).topk(2, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        return self.experts(h, idx, weights), h.new_zeros(()), None


class Block(nn.Module):
    def __init__(self, ep_size: int, expert_tp: bool, kind: str = "moe") -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, DIM))
        self.moe: nn.Module
        if kind == "dropless":  # top-2 softmax, Switch aux loss 0.01 and z-loss in its loss
            from slipstream.moe import DroplessMoE, RouterConfig

            cfg = RouterConfig(k=2, z_loss_coef=1e-3)
            self.moe = DroplessMoE(DIM, HIDDEN, EXPERTS, ep_size, cfg)
            return
        if kind == "autoep":
            self.moe = AutoEPBlock(ep_size)
            return
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
    def __init__(self, ep_size: int = 1, expert_tp: bool = False, kind: str = "moe") -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(ep_size, expert_tp, kind)])
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        block = self.blocks[0]
        h = x + block.mlp(x)
        m, l_aux, _ = block.moe(h)
        return ((self.head(h + m) - y) ** 2).mean() + 0.01 * l_aux


def reference(kind: str = "moe") -> Net:
    torch.manual_seed(0)
    return Net(kind=kind)


def _global(name: str, ep_rank: int, ep_size: int) -> str | None:
    """The one-process name of local parameter ``name`` (None: another rank's expert)."""
    if not name.startswith(PREFIX):
        return name
    lid, rest = name[len(PREFIX) :].split(".", 1)
    return f"{PREFIX}{int(lid) + ep_rank * (EXPERTS // ep_size)}.{rest}"


def local_copy(ref: Net, ep_size: int, ep_rank: int, expert_tp: bool, kind: str = "moe") -> Net:
    """The ``ep_size`` model of expert-parallel rank ``ep_rank`` with ``ref``'s weights."""
    net = Net(ep_size, expert_tp, kind)
    full = ref.state_dict()
    if kind != "moe":  # stacked experts
        net.load_state_dict(
            {n: local_experts(full, n, ep_rank, ep_size).clone() for n in net.state_dict()}
        )
        return net
    net.load_state_dict(
        {n: full[str(_global(n, ep_rank, ep_size))].clone() for n in net.state_dict()}
    )
    return net


def local_experts(
    full: dict[str, torch.Tensor], name: str, ep_rank: int, ep_size: int
) -> torch.Tensor:
    """Dropless layout: the one-process tensor ``name``, cut to expert-parallel rank
    ``ep_rank``'s experts (dim 0) when it is a stacked expert weight."""
    if not name.startswith(DROPLESS_PREFIX):
        return full[name]
    local = EXPERTS // ep_size
    return full[name][ep_rank * local : (ep_rank + 1) * local]


def batches(shard: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + shard)
    scale = torch.linspace(0.2, 2.0, DIM).roll(3 * shard)
    return [
        (torch.rand(TOKENS, DIM, generator=g) * scale, torch.randn(TOKENS, DIM, generator=g))
        for _ in range(STEPS)
    ]


def reference_run(shards: int, kind: str = "moe") -> dict[str, Any]:
    """One process: each step averages the shards' losses (what data parallelism computes)."""
    net = reference(kind)
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


def _config(stage: int, tp: int, bf16: bool = False) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 300},
        "gradient_clipping": CLIP,
        "tensor_parallel": {"autotp_size": tp},
        "bf16": {"enabled": bf16},
    }


def _params(
    engine: Any, ep_rank: int, ep_size: int, stacked: bool = False
) -> dict[str, tuple[torch.Tensor, Any]]:
    """This rank's parameters by one-process name, with their TP slice record (``stacked``
    experts: the names are the one-process ones, the stacked experts this rank's slice)."""
    with slipstream.zero.GatheredParameters(list(engine.module.parameters())):
        return {
            (n if stacked else str(_global(n, ep_rank, ep_size))): (
                p.detach().float().clone(),
                tp_shard(p),
            )
            for n, p in engine.module.named_parameters()
        }


def _train(
    tp: int,
    ep: int,
    expert_tp: bool,
    stage: int,
    ckpt: str | None,
    bf16: bool = False,
    kind: str = "moe",
) -> dict[str, Any]:
    rank = dist.get_rank()
    dp_rank, ep_rank = rank // tp, (rank // tp) % ep
    net = local_copy(reference(kind), ep, ep_rank, expert_tp, kind)
    engine, _, _, _ = slipstream.initialize(
        model=net, model_parameters=net.parameters(), config=_config(stage, tp, bf16)
    )
    res: dict[str, Any] = {"losses": [], "norms": [], "dp_rank": dp_rank, "ep_rank": ep_rank}
    dtype = torch.bfloat16 if bf16 else torch.float32
    for x, y in batches(dp_rank):
        loss = engine(x.to(dtype), y.to(dtype))
        engine.backward(loss)
        engine.step()
        res["losses"].append(float(loss))
        res["norms"].append(engine.get_global_grad_norm())
    stacked = kind != "moe"
    res["params"] = _params(engine, ep_rank, ep, stacked)
    experts = DROPLESS_PREFIX if stacked else PREFIX
    res["expert_split"] = any(
        tp_shard(p) is not None for n, p in engine.module.named_parameters() if experts in n
    )
    moe = engine.module.blocks[0].moe
    layer = moe.experts if kind == "autoep" else moe
    exchange = layer.exchange if stacked else moe.deepspeed_moe.exchange
    res["exchange"] = getattr(exchange, "__name__", type(exchange).__name__)
    res["edp"] = sorted(
        {comm_size(b.expert.edp_group) for b in engine.optimizer.buckets if b.expert is not None}
    )
    if ckpt is not None:
        engine.save_checkpoint(ckpt, tag="t")
    engine.destroy()
    return res


def a2a_rows() -> dict[str, Any]:
    """tp 2 x ep 2 with expert TP: one forward and backward with each TP rank sending its
    share of the rows (the default), then with every row sent whole on every TP rank (the
    layer's TP group unset); the rows each expert all-to-all sent, the losses and the local
    gradients of both."""
    from slipstream.distributed import comm

    rank = dist.get_rank()
    dp_rank, ep_rank = rank // 2, (rank // 2) % 2
    net = local_copy(reference(), 2, ep_rank, True)
    engine, _, _, _ = slipstream.initialize(
        model=net, model_parameters=net.parameters(), config=_config(0, 2)
    )
    layer = engine.module.blocks[0].moe.deepspeed_moe
    real = comm.all_to_all_single
    sent: list[int] = []

    def counting(output: Any, input: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("label") == "moe_a2a":
            sent.append(int(input.shape[0]))
        return real(output, input, *args, **kwargs)

    res: dict[str, Any] = {}
    x, y = batches(dp_rank)[0]
    comm.all_to_all_single = counting  # type: ignore[assignment]
    try:
        for name in ("shared", "whole"):
            if name == "whole":
                layer.expert_tp_group = None
            sent.clear()
            loss = engine.module(x, y)
            loss.backward()
            grads = {n: p.grad.clone() for n, p in engine.module.named_parameters()}
            engine.module.zero_grad(set_to_none=True)
            res[name] = {"rows": list(sent), "loss": float(loss), "grads": grads}
    finally:
        comm.all_to_all_single = real  # type: ignore[assignment]
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
    """What is refused, by message: an ep_size not dividing data x sequence parallel ranks;
    expert TP asked for but the experts left whole; a dropless layer of ep_size 2 whose
    experts a TP plan split."""
    from slipstream.distributed.expert import expert_groups
    from slipstream.distributed.mesh import ParallelDims, build_mesh
    from slipstream.moe import DroplessMoE, expert_parallel_

    tp_mesh = build_mesh(ParallelDims(world_size=4, tp=2))
    sp_mesh = build_mesh(ParallelDims(world_size=4, sp=2))
    dropless = nn.Sequential(DroplessMoE(DIM, HIDDEN, EXPERTS, 2))
    # Its grouped experts are whole on every TP rank (TPTokenSplit); a plan that split them:
    set_tp_shard_(dropless[0].experts.w1, TPShard(dim=2, parts=1, rank=dist.get_rank() % 2, size=2))
    return {
        "sp": _error(lambda: expert_groups(sp_mesh, 3)),
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
    for expert_tp in (False, True):
        out[f"tp2_ep2_z3_{expert_tp}"] = _train(2, 2, expert_tp, 3, None)
    out["tp2_ep2_bf16"] = _train(2, 2, False, 2, None, bf16=True)
    out["a2a_rows"] = a2a_rows()
    for kind in ("dropless", "autoep"):
        out[f"ref_{kind}"] = reference_run(2, kind)
        out[f"{kind}_tp2_ep2"] = _train(2, 2, False, 1, None, kind=kind)
    out["ep2_edp2"] = _train(1, 2, False, 2, None)
    out["ref_sp"] = sp_reference()
    out["ep2_sp2_z0"] = sp_train(0, None)  # whole expert gradients: norm summed over ep
    out["ep2_sp2"] = sp_train(2, f"{tmp}/ep_sp")
    dist.barrier()
    out["reload_sp"] = sp_reload(f"{tmp}/ep_sp")
    return out


def expected(ref: dict[str, torch.Tensor], name: str, shard: Any) -> torch.Tensor:
    """The one-process tensor ``name``, cut to ``shard`` when this rank holds a TP slice."""
    full = ref[name]
    return full if shard is None else tp_slice(full, shard)


# -- ep 2 over sp 2 x dp 2: the reference GPT with Ulysses attention and one MoE block ------

SP_BATCH, SP_SEQ, SP_VOCAB, SP_LR = 4, 16, 64, 0.05
SP_PREFIX = "layers.1.mlp.moe.deepspeed_moe.experts.deepspeed_experts."


def sp_model(ep_size: int) -> nn.Module:
    """Two blocks, the second an MoE (4 experts, top-1, every token kept: drop_tokens False;
    no load-balancing loss, which is each rank's own tokens' under sequence parallelism)."""
    from slipstream.models import GPT, GPTConfig, GPTMoEConfig

    moe = GPTMoEConfig(num_experts=EXPERTS, k=1, ep_size=ep_size, aux_loss_coef=0.0)
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(
            vocab_size=SP_VOCAB, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=2,
            max_seq_len=SP_SEQ, sequence_parallel="ulysses", moe=moe,
        )
    )  # fmt: skip
    model.layers[1].mlp.moe.deepspeed_moe.gate.drop_tokens = False
    return model


def sp_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(300 + step)
    ids = torch.randint(0, SP_VOCAB, (SP_BATCH, SP_SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _sp_name(name: str, ep_rank: int) -> str:
    if not name.startswith(SP_PREFIX):
        return name
    lid, rest = name[len(SP_PREFIX) :].split(".", 1)
    return f"{SP_PREFIX}{int(lid) + ep_rank * (EXPERTS // 2)}.{rest}"


def sp_reference() -> dict[str, Any]:
    """One process, the whole batch, ep_size 1: losses, gradients (before clipping), params."""
    net = sp_model(1)
    opt = torch.optim.SGD(net.parameters(), lr=SP_LR, momentum=0.9)
    out: dict[str, Any] = {"losses": [], "grads": [], "norms": []}
    for step in range(STEPS):
        loss = net(*sp_batch(step))
        loss.backward()
        out["grads"].append({n: p.grad.clone() for n, p in net.named_parameters()})
        out["norms"].append(float(nn.utils.clip_grad_norm_(net.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        out["losses"].append(float(loss.detach()))
    out["params"] = {n: p.detach().clone() for n, p in net.named_parameters()}
    return out


def _sp_config(stage: int = 2) -> dict[str, Any]:
    return {
        "train_batch_size": SP_BATCH,
        "optimizer": {"type": "SGD", "params": {"lr": SP_LR, "momentum": 0.9}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 500},
        "gradient_clipping": CLIP,
        "sequence_parallel_size": 2,
    }


def sp_reload(ckpt: str) -> dict[str, torch.Tensor]:
    """The ep 2 checkpoint into an ep 1 engine at sp 2 x dp 2: every expert by global id."""
    engine, _, _, _ = slipstream.initialize(model=sp_model(1), config=_sp_config())
    engine.load_checkpoint(ckpt, tag="t")
    with slipstream.zero.GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return params


def sp_train(stage: int, ckpt: str | None) -> dict[str, Any]:
    """sp 2 x dp 2 (Ulysses), ep 2, ZeRO ``stage``: this rank's rows, then its sequence
    shard; saved to ``ckpt`` after the last step."""
    from slipstream.utils.tensor_fragment import safe_get_full_grad

    rank = dist.get_rank()
    ep_rank = rank % 2  # sp is the innermost axis: ep groups {0, 1} and {2, 3}
    ref = sp_model(1).state_dict()
    net = sp_model(2)
    net.load_state_dict({n: ref[_sp_name(n, ep_rank)].clone() for n in net.state_dict()})
    engine, _, _, _ = slipstream.initialize(model=net, config=_sp_config(stage))
    mesh = engine.mesh
    groups = engine.module.layers[1].mlp.moe.deepspeed_moe
    res: dict[str, Any] = {
        "losses": [],
        "grads": [],
        "norms": [],
        "ep_rank": dist.get_rank(groups.ep_group),
        "ep_ranks": dist.get_process_group_ranks(groups.ep_group),
        "edp": sorted(
            {comm_size(b.expert.edp_group) for b in engine.optimizer.buckets if b.expert}
        ),
    }
    dp, dp_rank = mesh["dp_shard"].size(), mesh.get_local_rank("dp_shard")
    sp_rank = mesh.get_local_rank("sp")
    rows = slice(dp_rank * SP_BATCH // dp, (dp_rank + 1) * SP_BATCH // dp)
    for step in range(STEPS):
        x, y = (t[rows].chunk(2, dim=1)[sp_rank].contiguous() for t in sp_batch(step))
        loss = engine(x, y)
        engine.backward(loss)
        res["grads"].append(
            {
                _sp_name(n, ep_rank): safe_get_full_grad(p).clone()
                for n, p in engine.module.named_parameters()
            }
        )
        engine.step()
        total = loss.detach().clone()  # the same on both sp ranks; the dp halves' mean
        dist.all_reduce(total)
        res["losses"].append(float(total) / dist.get_world_size())
        res["norms"].append(engine.get_global_grad_norm())
    with slipstream.zero.GatheredParameters(list(engine.module.parameters())):
        res["params"] = {
            _sp_name(n, ep_rank): p.detach().clone() for n, p in engine.module.named_parameters()
        }
    if ckpt is not None:
        engine.save_checkpoint(ckpt, tag="t")
    engine.destroy()
    return res
