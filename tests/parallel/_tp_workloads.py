"""Rank bodies and single-process references for the tensor-parallel tests."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from slipstream.models import GPT, GPTConfig
from slipstream.parallel.random import MODEL_PARALLEL_RNG, get_rng_tracker
from slipstream.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    unshard_tp,
    vocab_parallel_cross_entropy,
)

STEPS = 5
BATCH = 8
SEQ = 16
VOCAB = 128
LR = 0.3
# SGD with momentum, not Adam: Adam's invariance to gradient scale would hide a TP-fold error.


def gpt_config(**overrides: Any) -> GPTConfig:
    base: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=4, max_seq_len=32
    )
    return GPTConfig(**(base | overrides))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def _hf_llama(tie: bool = False) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )
    model = LlamaForCausalLM(cfg)
    model.config._attn_implementation = "eager"
    return model


def _hf_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(4)
    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_positions=32,
        n_embd=64,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = GPT2LMHeadModel(cfg)
    model.config._attn_implementation = "eager"
    return model


def make_model(kind: str) -> nn.Module:
    if kind == "gpt":
        torch.manual_seed(5)
        return GPT(gpt_config())
    if kind == "gpt_ckpt":  # same weights as "gpt", blocks recomputed in backward
        torch.manual_seed(5)
        return GPT(gpt_config(activation_checkpointing=True))
    if kind == "gpt_tied":
        torch.manual_seed(5)
        return GPT(gpt_config(tie_embeddings=True))
    if kind == "llama":
        return _hf_llama()
    if kind == "gpt2":
        return _hf_gpt2()
    raise ValueError(kind)


def _loss(model: nn.Module, kind: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if kind.startswith("gpt") and kind != "gpt2":
        return model(x, y)
    # HF shifts labels itself: give it the full sequence with -100 on the first position.
    return model(input_ids=x, labels=torch.cat([x[:, :1], y], 1)[:, :-1].clone()).loss


def reference_run(kind: str, clip: float | None = None) -> dict[str, Any]:
    model = make_model(kind)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for x, y in batches():
        loss = _loss(model, kind, x, y)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "params": {n: p.detach() for n, p in model.named_parameters()}}


def engine_run(
    kind: str, tp: int, stage: int, sequence_parallel: bool = False, clip: float | None = None
) -> dict[str, Any]:
    """Train through slipstream.initialize; losses averaged over ranks, full parameters."""
    import slipstream

    world = dist.get_world_size()
    dp = world // tp
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": BATCH // dp,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "tensor_parallel": {"autotp_size": tp, "sequence_parallel": sequence_parallel},
        "seed": 1,
    }
    # The reference clips only when asked (absent, the key would clip at 1.0).
    config["gradient_clipping"] = 0.0 if clip is None else clip
    if kind == "gpt_ckpt":  # checkpointed block inputs kept as 1/tp slices, gathered back
        config["activation_checkpointing"] = {"partition_activations": True}
    engine, *_ = slipstream.initialize(model=make_model(kind), config=config)
    dp_rank = dist.get_rank() // tp  # tp is the innermost mesh axis
    rows = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
    losses = []
    for x, y in batches():
        loss = _loss(engine, kind, x[rows], y[rows])
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
    tp_group = engine.mesh.get_group("tp")
    with slipstream.zero.GatheredParameters(list(engine.module.parameters())):
        params = {n: unshard_tp(p, tp_group).clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return {"losses": losses, "params": params if dist.get_rank() == 0 else None}


# ------------------------------------------------------------------------- layer checks
def layer_checks() -> dict[str, Any]:
    """Column/row/embedding layers and the vocab-parallel loss against the full versions."""
    group = dist.group.WORLD
    world, rank = dist.get_world_size(), dist.get_rank()
    out: dict[str, Any] = {}
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 8, generator=g)
    up, down = nn.Linear(8, 12 * world), nn.Linear(12 * world, 8)
    with torch.no_grad():
        for p in (*up.parameters(), *down.parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    ref_in = x.clone().requires_grad_()
    ref = down(F.gelu(up(ref_in)))
    ref.square().sum().backward()
    ref_grads = [p.grad.clone() for p in (up.weight, up.bias, down.weight)]
    col = ColumnParallelLinear.from_module(up, group)
    row = RowParallelLinear.from_module(down, group)
    local_in = x.clone().requires_grad_()
    y = row(F.gelu(col(local_in)))
    up.weight.grad = up.bias.grad = down.weight.grad = None
    y.square().sum().backward()
    out["mlp"] = (y.detach(), ref.detach(), local_in.grad, ref_in.grad)
    out["mlp_grads"] = [  # gradients are shards like their parameters
        (unshard_tp(p, group, p.grad), r)
        for p, r in zip((col.weight, col.bias, row.weight), ref_grads)
    ]
    emb = nn.Embedding(16 * world, 8)
    with torch.no_grad():
        emb.weight.copy_(torch.randn(emb.weight.shape, generator=g))
    ids = torch.randint(0, 16 * world, (3, 5), generator=g)
    ref_emb = emb(ids).detach()
    out["embedding"] = (VocabParallelEmbedding.from_module(emb, group)(ids).detach(), ref_emb)
    # vocab-parallel cross-entropy with ignored positions
    logits = torch.randn(6, 10, 8 * world, generator=g)
    labels = torch.randint(0, 8 * world, (6, 10), generator=g)
    labels[0, :3] = -100
    full = logits.clone().requires_grad_()
    ref_loss = F.cross_entropy(full.view(-1, 8 * world), labels.view(-1))
    ref_loss.backward()
    shard = logits.chunk(world, -1)[rank].clone().requires_grad_()
    with _MaxNumel() as seen:
        loss = vocab_parallel_cross_entropy(shard, labels, group)
        loss.backward()
    out["ce"] = (loss.detach(), ref_loss.detach(), shard.grad, full.grad.chunk(world, -1)[rank])
    out["ce_max_numel"] = (seen.max_numel, 60 * 8 * world)
    return out


class _MaxNumel(TorchDispatchMode):
    """Largest tensor any op produced while active."""

    def __init__(self) -> None:
        super().__init__()
        self.max_numel = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        result = func(*args, **(kwargs or {}))
        for t in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
        return result


def rng_checks() -> dict[str, Any]:
    """Dropout masks: inside the TP stream they differ per rank, outside they are equal."""
    import slipstream

    torch.manual_seed(0)
    from slipstream.parallel.random import model_parallel_manual_seed

    model_parallel_manual_seed(0, dist.get_rank())
    ones = torch.ones(4096)
    outside = F.dropout(ones, 0.5)
    with get_rng_tracker().fork(MODEL_PARALLEL_RNG):
        inside = F.dropout(ones, 0.5)
    after = F.dropout(ones, 0.5)
    masks = [torch.zeros(3, 4096) for _ in range(dist.get_world_size())]
    dist.all_gather(masks, torch.stack([outside, inside, after]))
    # A GPT with dropout under TP (and under TP + sequence parallel): the residual stream
    # entering each block must stay identical on all TP ranks, or the replicas diverge.
    streams = {}
    for sp in (False, True):
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "tensor_parallel": {"autotp_size": dist.get_world_size(), "sequence_parallel": sp},
            "seed": 3,
        }
        torch.manual_seed(5)
        engine, *_ = slipstream.initialize(model=GPT(gpt_config(dropout=0.3)), config=config)
        seen: list[torch.Tensor] = []
        hook = engine.module.layers[1].register_forward_pre_hook(
            lambda m, args, seen=seen: seen.append(args[0].detach().clone())
        )
        for x, y in batches()[:2]:
            loss = engine(x[:2], y[:2])
            engine.backward(loss)
            engine.step()
        hook.remove()
        norm = engine.module.layers[0].attn_norm.weight.detach()
        streams[sp] = (_all_gather(seen[-1]), _all_gather(norm), float(norm.sub(1).abs().max()))
        engine.destroy()
    return {"masks": masks, "streams": streams}


def _all_gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def _ckpt_engine(tp: int, stage: int) -> Any:
    import slipstream

    config = {
        "train_micro_batch_size_per_gpu": BATCH // (dist.get_world_size() // tp),
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage},
        "tensor_parallel": {"autotp_size": tp},
        "seed": 1,
    }
    torch.manual_seed(5)
    engine, *_ = slipstream.initialize(model=GPT(gpt_config()), config=config)
    return engine


def _train(engine: Any, steps: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    losses = []
    for x, y in steps:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses


def checkpoint_checks(root: str) -> dict[str, Any]:
    """TP=2 x ZeRO-1: save after 2 steps, resume in a new engine: the same next losses."""
    data = batches()
    engine = _ckpt_engine(2, 1)
    _train(engine, data[:2])
    engine.save_checkpoint(root, tag="s2")
    straight = _train(engine, data[2:])
    engine.save_16bit_model(f"{root}/export")  # full tensors from the TP shards
    tp_group = engine.mesh.get_group("tp")
    full = {n: unshard_tp(p, tp_group) for n, p in engine.module.named_parameters()}
    exported = _read_export(f"{root}/export")
    engine.destroy()
    engine = _ckpt_engine(2, 1)
    engine.load_checkpoint(root, tag="s2")
    resumed = _train(engine, data[2:])
    engine.destroy()
    export_ok = exported.keys() >= full.keys() and all(
        torch.equal(exported[n], full[n].to(torch.bfloat16)) for n in full
    )
    return {"straight": straight, "resumed": resumed, "export_ok": export_ok}


def _read_export(path: str) -> dict[str, torch.Tensor]:
    from pathlib import Path

    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out |= load_file(str(f))
    return out


def world2(runs: list[tuple[Any, ...]], root: str) -> dict[str, Any]:
    return {
        "layers": layer_checks(),
        "rng": rng_checks(),
        "runs": {r: engine_run(*r) for r in runs},
        "checkpoint": checkpoint_checks(root),
    }


def world4(runs: list[tuple[Any, ...]]) -> dict[str, Any]:
    return {"layers": layer_checks(), "runs": {r: engine_run(*r) for r in runs}}
