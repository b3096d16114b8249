"""Rank bodies and single-process references for sequence parallelism composed with tensor
parallelism (sp 2 x tp 2 on 4 ranks): a tiny Hugging Face LLaMA with grouped-query attention
and the reference GPT, batches fed by hand (the global batch of a step, cut for this rank)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tests._tiny_models import tiny_llama

STEPS, SAVE_AT = 3, 2  # AdamW steps; the checkpoint is written after SAVE_AT of them
BATCH, SEQ, VOCAB = 4, 16, 96
LR = 1e-2
SP, TP = 2, 2
CLIP = 1.0  # the GPT's gradient norms are 1.9-2.5: the ZeRO-2 run clips at every step


def make_model(kind: str) -> nn.Module:
    """``llama``: 4 heads, 2 KV heads (per TP rank 2 and 1: the KV head is replicated for
        Ulysses); ``llama6``: 6 heads, 2 KV heads (3 per TP rank: Ulysses over 2 is refused, ring
        takes it); ``gpt``/``gpt_ring``/``gpt_lss``/``gpt6``: the reference GPT likewise (the
    first three with the same weights)."""
    from slipstream.models import GPT, GPTConfig

    if kind == "llama":
        return tiny_llama(layers=2, vocab=VOCAB, hidden=64, eval=False)
    if kind == "llama6":
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        cfg = LlamaConfig(
            vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64,
        )  # fmt: skip
        return LlamaForCausalLM(cfg)
    heads, hidden = (6, 48) if kind == "gpt6" else (4, 64)
    mode = {"gpt_ring": "ring", "gpt_lss": "lss"}.get(kind, "ulysses")
    torch.manual_seed(0)
    return GPT(
        GPTConfig(
            vocab_size=VOCAB, hidden_size=hidden, num_layers=2, num_heads=heads, num_kv_heads=2,
            max_seq_len=64, sequence_parallel=mode,
        )
    )  # fmt: skip


def global_batch(step: int) -> dict[str, torch.Tensor]:
    """Step ``step``'s ``[BATCH, SEQ]`` tokens; the first tokens of the rows are not counted
    (-100), so the sequence shards count different numbers of tokens (the two halves of the
    batch count the same: a 2-way data-parallel mean of means is the token mean too)."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    labels = ids.clone()
    p, q = (2 + 3 * step) % 9, (7 + 2 * step) % 9
    for row, prefix in enumerate((p, q, q, p)):
        labels[row, :prefix] = -100
    return {"ids": ids[:, :-1], "next": labels[:, 1:], "labels": labels[:, :-1]}


def _is_hf(kind: str) -> bool:
    return kind.startswith("llama")


def reference_run(kind: str, clip: float | None = None) -> dict[str, Any]:
    """One process, the whole batch, torch's AdamW (gradients clipped to norm ``clip``):
    losses, every step's gradients (before clipping), final parameters."""
    model = make_model(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses, grads = [], []
    for step in range(STEPS):
        loss = _forward(model, kind, global_batch(step), None)
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "grads": grads, "params": params}


def _forward(model: Any, kind: str, batch: dict[str, torch.Tensor], cut: Any) -> torch.Tensor:
    """The loss of ``batch`` (``cut``: this rank's part of it, None for all of it)."""
    if _is_hf(kind):
        # The HF model shifts labels itself; under sequence parallelism the shard carries
        # labels already shifted on the full sequence (shard_causal_lm_batch).
        part = {"input_ids": batch["ids"], "labels": batch["labels"]}
        return model(**(cut(part, True) if cut else part)).loss
    x, y = batch["ids"], batch["next"]
    if cut is not None:
        x, y = cut(x, False), cut(y, False)
    return model(x, y)


def _cutter(engine: Any, mode: str) -> Any:
    """This rank's part of a global batch: its data-parallel rows, then its sequence shard
    (contiguous for Ulysses, zig-zag for ring; shifted labels for a HF model)."""
    from slipstream.sequence import (
        shard_batch_zigzag,
        shard_causal_lm_batch,
        shard_causal_lm_batch_ring,
    )

    mesh = engine.mesh
    sp, sp_rank = mesh["sp"].size(), mesh.get_local_rank("sp")
    dp = mesh["dp_shard"].size()
    rows = slice(
        mesh.get_local_rank("dp_shard") * BATCH // dp,
        (mesh.get_local_rank("dp_shard") + 1) * BATCH // dp,
    )

    def cut(part: Any, hf: bool) -> Any:
        if hf:
            part = {k: v[rows] for k, v in part.items()}
            if sp == 1:
                return part
            shard = shard_causal_lm_batch_ring if mode == "ring" else shard_causal_lm_batch
            return shard(part, sp, sp_rank)
        part = part[rows]
        if sp == 1:
            return part
        if mode == "ring":
            return shard_batch_zigzag(part, sp, sp_rank)
        return part.chunk(sp, dim=1)[sp_rank].contiguous()

    return cut


def config(stage: int, sp: int = SP, mode: str = "ulysses", **extra: Any) -> dict[str, Any]:
    return {
        "train_batch_size": BATCH,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "sequence_parallel_size": sp,
        "sequence_parallel_mode": mode,
        "tensor_parallel": {"autotp_size": TP},
        "gradient_clipping": 0.0,
        "seed": 7,
        **extra,
    }


def _full(engine: Any, grads: bool) -> dict[str, torch.Tensor]:
    """Full parameters (or their gradients, dp x sp averaged) gathered over ZeRO and TP."""
    import slipstream
    from slipstream.parallel.tensor import unshard_tp
    from slipstream.utils.tensor_fragment import safe_get_full_grad

    tp_group = engine.mesh.get_group("tp")
    named = list(engine.module.named_parameters())
    if grads:
        return {n: unshard_tp(p, tp_group, safe_get_full_grad(p)).float() for n, p in named}
    with slipstream.zero.GatheredParameters([p for _, p in named]):
        return {n: unshard_tp(p, tp_group).float().clone() for n, p in named}


def train(
    kind: str,
    stage: int,
    *,
    mode: str = "ulysses",
    sp: int = SP,
    steps: range = range(STEPS),
    save: str | None = None,
    load: str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """Train ``kind`` through ``slipstream.initialize`` at sp x tp 2 on this world."""
    import slipstream

    engine, *_ = slipstream.initialize(
        model=make_model(kind), config=config(stage, sp, mode, **extra)
    )
    if load is not None:
        assert engine.load_checkpoint(load)[0] is not None, load
    cut = _cutter(engine, mode)
    losses, grads = [], []
    for step in steps:
        loss = _forward(engine, kind, global_batch(step), cut)
        engine.backward(loss)
        grads.append(_full(engine, grads=True))
        engine.step()
        total = loss.detach().float().clone()  # equal over sp and tp; data-parallel halves
        dist.all_reduce(total)  # count the same tokens (global_batch): their mean is the loss
        losses.append(float(total) / dist.get_world_size())
        if save is not None and step == SAVE_AT - 1:
            engine.save_checkpoint(save)
    out = {"losses": losses, "grads": grads, "params": _full(engine, grads=False)}
    engine.destroy()
    return out


def loader_run() -> dict[str, Any]:
    """``_hf_workloads``' LLaMA (4 heads, 2 KV heads; SGD) at sp 2 x tp 2 read from the
    loader ``initialize`` builds (the TP ranks of a sequence shard get the same tokens), 3
    steps: losses and full parameters, for ``_hf_workloads.reference_run``."""
    import slipstream
    from tests.sequence import _hf_workloads as hw

    cfg = hw._config(2, SP) | {"tensor_parallel": {"autotp_size": TP}}
    engine, _, loader, _ = slipstream.initialize(
        model=hw.make_model("llama_gqa2"), config=cfg, training_data=hw.LMData()
    )
    losses = []
    for _, batch in zip(range(hw.STEPS), loader):
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    out = {"losses": losses, "params": _full(engine, grads=False)}
    engine.destroy()
    return out


def refusal(kind: str, **extra: Any) -> str:
    import slipstream

    try:
        slipstream.initialize(model=make_model(kind), config=config(0, **extra))
    except ValueError as err:
        return str(err)
    return "no error"


def world(root: str) -> dict[str, Any]:
    """Every sp 2 x tp 2 check of the test file, in one 4-rank world."""
    rank = dist.get_rank()
    runs = {
        "llama ulysses zero1": train("llama", 1, save=f"{root}/llama"),
        "gpt ulysses zero2 clip": train("gpt", 2, gradient_clipping=CLIP),
        "llama6 ring zero3": train("llama6", 3, mode="ring"),
        "gpt ring zero1": train("gpt_ring", 1, mode="ring"),
        "gpt lss zero0": train("gpt_lss", 0),
        "llama resume sp1 dp2": train("llama", 1, sp=1, steps=range(SAVE_AT, STEPS), load=f"{root}/llama"),
        "gpt ulysses bf16 zero2": train("gpt", 2, bf16={"enabled": True}),
        "llama loader sgd zero2": loader_run(),
    }  # fmt: skip
    refused = {
        "llama6": refusal("llama6"),
        "gpt6": refusal("gpt6"),
        "megatron_sp": refusal("gpt", tensor_parallel={"autotp_size": TP, "sequence_parallel": True}),
    }  # fmt: skip
    if rank:  # every rank ran the same; rank 0 reports (its losses are the group's)
        return {"losses": {k: v["losses"] for k, v in runs.items()}}
    return {"runs": runs, "refused": refused}
