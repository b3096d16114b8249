"""Rank bodies and single-process references for the sequence-parallel tests."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from slipstream.distributed import comm
from slipstream.distributed.mesh import ParallelDims, build_mesh, dp_group
from slipstream.models import GPT, GPTConfig
from slipstream.sequence import (
    DistributedAttention,
    double_average_gradients_,
    lss_attention,
    sdpa_attention,
    sequence_parallel_cross_entropy,
    ulysses_attention,
)

STEPS = 4
SEQ = 16
SAMPLES = 16
# SGD, not Adam: Adam is invariant to a constant gradient scale, which would hide the
# P-fold errors sequence parallelism is prone to.
LR = 0.5


# ----------------------------------------------------------------------------- attention
def _qkv(b: int, s: int, h: int, kv: int, d: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(h * 100 + kv)
    q, k, v = (torch.randn(b, s, n, d, generator=g) for n in (h, kv, kv))
    return q, k, v, torch.randn(b, s, h, d, generator=g)


def attention_cases(cases: list[tuple[str, bool, int, int]]) -> dict[Any, Any]:
    """Per case (method, causal, H, kv): distributed and reference output/grad slices."""
    group = dist.group.WORLD
    world, rank = dist.get_world_size(), dist.get_rank()
    out: dict[Any, Any] = {}
    for method, causal, h, kv in cases:
        q, k, v, w = _qkv(2, 4 * world, h, kv, 4)
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        (sdpa_attention(*ref, causal=causal) * w).sum().backward()
        seg = slice(rank * 4, (rank + 1) * 4)
        loc = [t[:, seg].clone().requires_grad_() for t in (q, k, v)]
        if method == "ulysses":
            o = ulysses_attention(*loc, group, causal=causal)
        elif method == "lss":
            o = lss_attention(*loc, group, causal=causal)
        else:  # DeepSpeed's module in its default sequence-first layout [S, B, H, D]
            mod = DistributedAttention(
                lambda a, b, c, causal=causal: sdpa_attention(
                    a.transpose(0, 1), b.transpose(0, 1), c.transpose(0, 1), causal=causal
                ).transpose(0, 1),
                group,
                scatter_idx=2,
                gather_idx=0,
            )
            o = mod(*(t.transpose(0, 1) for t in loc)).transpose(0, 1)
        (o * w[:, seg]).sum().backward()
        with torch.no_grad():
            ref_out = sdpa_attention(q, k, v, causal=causal)[:, seg]
        out[(method, causal, h, kv)] = {
            "got": [o.detach()] + [t.grad for t in loc],
            "ref": [ref_out] + [t.grad[:, seg] for t in ref],
        }
    return out


def comm_per_layer() -> dict[str, dict[str, tuple[int, int]]]:
    """Collective calls and bytes of one attention forward + backward, per method."""
    group = dist.group.WORLD
    world = dist.get_world_size()
    result = {}
    for method in ("ulysses", "lss"):
        q, k, v, w = _qkv(2, 8 * world, 4, 4, 8)
        loc = [t[:, :8].clone().requires_grad_() for t in (q, k, v)]
        comm.comm_counters.reset()
        fn = ulysses_attention if method == "ulysses" else lss_attention
        (fn(*loc, group, causal=True) * w[:, :8]).sum().backward()
        result[method] = {op: (s.calls, s.bytes) for (_, op), s in comm.comm_counters.stats.items()}
    return result


# ------------------------------------------------------------------------------ training
def make_gpt(sp: str | None) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.preset("tiny", max_seq_len=SEQ, sequence_parallel=sp))


class PosEmbLM(nn.Module):
    """A one-block causal LM with a *learned absolute* position embedding (no RoPE): the
    parameter whose gradient comes from every segment of every sequence."""

    def __init__(self, sequence_parallel: str | None = None, vocab: int = 64, dim: int = 32):
        super().__init__()
        torch.manual_seed(0)
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(SEQ, dim) * 0.1)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.heads, self.sequence_parallel = 4, sequence_parallel
        self.sp_group: comm.Group = None

    def set_sequence_parallel_group(self, group: comm.Group) -> None:
        self.sp_group = group

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        start = comm.get_rank(self.sp_group) * t if self.sp_group is not None else 0
        x = self.tok(ids) + self.pos[start : start + t]
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, -1).unbind(2)
        if self.sp_group is None:
            a = sdpa_attention(q, k, v)
        elif self.sequence_parallel == "lss":
            a = lss_attention(q, k, v, self.sp_group)
        else:
            a = ulysses_attention(q, k, v, self.sp_group)
        x = x + self.proj(a.reshape(b, t, -1))
        logits = self.head(x + self.mlp(x))
        if self.sp_group is None:
            return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1))
        return sequence_parallel_cross_entropy(logits, labels, self.sp_group)


def make_model(kind: str, sp: str | None) -> nn.Module:
    return make_gpt(sp) if kind == "gpt" else PosEmbLM(sp)


class TokenData(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, vocab: int = 64) -> None:
        g = torch.Generator().manual_seed(1234)
        self.tokens = torch.randint(0, vocab, (SAMPLES, SEQ + 1), generator=g)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tokens[i, :-1], self.tokens[i, 1:]


def _config(stage: int, sp: int, global_batch: int) -> dict[str, Any]:
    return {
        "train_batch_size": global_batch,
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "sequence_parallel_size": sp,
        "seed": 7,
        "gradient_clipping": 0.0,  # the single-process reference does not clip
    }


def engine_run(kind: str, method: str, stage: int, sp: int, global_batch: int) -> dict[str, Any]:
    """Train through ``slipstream.initialize`` with the loader it builds; rank-0 view."""
    import slipstream

    model = make_model(kind, method)
    engine, _, loader, _ = slipstream.initialize(
        model=model, config=_config(stage, sp, global_batch), training_data=TokenData()
    )
    dp = dist.get_world_size() // sp
    losses, shapes = [], set()
    for _, (x, y) in zip(range(STEPS), loader):
        shapes.add(tuple(x.shape))
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)  # every sp rank holds its dp rank's loss: mean over all
        losses.append(float(total) / (dp * sp))
    with slipstream.zero.GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return {"losses": losses, "params": params, "shapes": sorted(shapes)}


def reference_run(kind: str, global_batch: int) -> dict[str, Any]:
    """One process, the whole global batch, the sampler's order (seed 7)."""
    model = make_model(kind, None)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(7)).tolist()
    data = TokenData()
    losses = []
    for step in range(STEPS):
        idx = order[step * global_batch : (step + 1) * global_batch]
        x, y = torch.stack([data[i][0] for i in idx]), torch.stack([data[i][1] for i in idx])
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "params": {n: p.detach() for n, p in model.named_parameters()}}


def training_matrix(runs: list[tuple[str, str, int, int, int]]) -> dict[Any, Any]:
    return {r: engine_run(*r) for r in runs}


# ------------------------------------------------------- LSS double gradient averaging
def _lss_loss(params: dict[str, torch.Tensor], tokens: torch.Tensor, group: comm.Group) -> Any:
    """Mean CE over ``tokens``' positions of a 1-block LM whose ``pos`` rows are its own."""
    x = params["tok"][tokens[:, :-1]] + params["pos"]
    b, t, e = x.shape
    q, k, v = ((x @ params[n]).view(b, t, 2, e // 2) for n in ("wq", "wk", "wv"))
    a = lss_attention(q, k, v, group) if group is not None else sdpa_attention(q, k, v)
    logits = (x + a.reshape(b, t, e)) @ params["head"]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def _lss_params(vocab: int = 32, e: int = 16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    shapes = {"tok": (vocab, e), "pos": (SEQ, e), "wq": (e, e), "wk": (e, e), "wv": (e, e)}
    shapes["head"] = (e, vocab)
    return {n: torch.randn(*s, generator=g) * 0.3 for n, s in shapes.items()}


def lss_double_averaging() -> dict[str, Any]:
    """D=2 sequences x N=2 segments: sharded PE rows, paper's per-segment mean loss."""
    mesh = build_mesh(ParallelDims(world_size=dist.get_world_size(), sp=2))
    seg_group, data_group = mesh.get_group("sp"), dp_group(mesh)
    n, d = comm.get_rank(seg_group), comm.get_rank(data_group)
    full = _lss_params()
    tokens = torch.randint(0, 32, (2, SEQ + 1), generator=torch.Generator().manual_seed(9))
    length = SEQ // 2
    seg_tokens = tokens[d : d + 1, n * length : (n + 1) * length + 1]
    local = {k: v.clone() for k, v in full.items()}
    local["pos"] = full["pos"][n * length : (n + 1) * length].clone()
    results = {}
    for mode in ("double", "naive"):
        ps = {k: nn.Parameter(v.clone()) for k, v in local.items()}
        _lss_loss(ps, seg_tokens, seg_group).backward()
        shared = [p for k, p in ps.items() if k != "pos"]
        if mode == "double":
            double_average_gradients_(shared, seg_group, data_group, segment_local=[ps["pos"]])
        else:  # the trap: sharded PE rows averaged over the data group only
            double_average_gradients_(shared, seg_group, data_group)
            pos_grad = ps["pos"].grad
            assert pos_grad is not None
            comm.all_reduce(pos_grad, group=data_group)
            pos_grad.div_(2)
        results[mode] = {k: p.grad for k, p in ps.items()}
    ref = {k: nn.Parameter(v.clone()) for k, v in full.items()}
    _lss_loss(ref, tokens, None).backward()
    ref_grads = {k: p.grad for k, p in ref.items()}
    assert ref_grads["pos"] is not None
    ref_grads["pos"] = ref_grads["pos"][n * length : (n + 1) * length]
    return {"results": results, "ref": ref_grads}


def world4(attn_cases: list[Any], runs: list[Any]) -> dict[str, Any]:
    return {
        "attention": attention_cases(attn_cases),
        "double": lss_double_averaging(),
        "training": training_matrix(runs),
    }


def world2(attn_cases: list[Any], runs: list[Any]) -> dict[str, Any]:
    return {
        "attention": attention_cases(attn_cases),
        "comm": comm_per_layer(),
        "training": training_matrix(runs),
    }
