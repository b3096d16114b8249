"""Rank bodies and single-process references for Ulysses on Hugging Face causal LMs."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

STEPS = 3
SEQ = 16
SAMPLES = 12
BATCH = 4
VOCAB = 64
# SGD, not Adam: Adam is invariant to a constant gradient scale, which would hide P-fold errors.
LR = 0.5

# name -> (family, num_attention_heads, num_key_value_heads, attention implementation)
MODELS = {
    "llama_gqa2": ("llama", 4, 2, "sdpa"),
    "llama_eager": ("llama", 4, 4, "eager"),
    "qwen2_kv1": ("qwen2", 4, 1, "sdpa"),  # GQA with fewer KV heads than P=2: replicated
    "llama_heads3": ("llama", 3, 3, "sdpa"),  # 3 heads over P=2: refused
}


def make_model(name: str) -> torch.nn.Module:
    """A tiny fp32 LlamaForCausalLM / Qwen2ForCausalLM built from a config, seeded."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    family, heads, kv, attn = MODELS[name]
    common = dict(
        vocab_size=VOCAB,
        hidden_size=8 * heads,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attn_implementation=attn,
    )
    torch.manual_seed(0)
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**common))
    return Qwen2ForCausalLM(Qwen2Config(**common))


class LMData(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Token rows whose labels are ignored (-100) on a varying prefix, so the sequence shards
    hold different numbers of counted tokens (a mean of per-shard means would be wrong)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)
        self.labels = self.ids.clone()
        for i in range(SAMPLES):
            self.labels[i, : (3 * i) % 11] = -100

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def _config(stage: int, sp: int) -> dict[str, Any]:
    return {
        "train_batch_size": BATCH,
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "sequence_parallel_size": sp,
        "seed": 7,
        "gradient_clipping": 0.0,
    }


def engine_run(name: str, stage: int) -> dict[str, Any]:
    """SP = world through ``slipstream.initialize`` and the loader it builds."""
    import slipstream

    sp = dist.get_world_size()
    model = make_model(name)
    engine, _, loader, _ = slipstream.initialize(
        model=model, config=_config(stage, sp), training_data=LMData()
    )
    losses, shapes, attn = [], set(), model.config._attn_implementation
    for _, batch in zip(range(STEPS), loader):
        shapes.add(tuple(batch["input_ids"].shape))
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    with slipstream.zero.GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return {"losses": losses, "params": params, "shapes": sorted(shapes), "attn": attn}


def refusal(name: str) -> str:
    import slipstream

    try:
        slipstream.initialize(model=make_model(name), config=_config(0, dist.get_world_size()))
    except ValueError as err:
        return str(err)
    return "no error"


def world(runs: list[tuple[str, int]], refused: list[str]) -> dict[str, Any]:
    return {
        "training": {r: engine_run(*r) for r in runs},
        "refused": {n: refusal(n) for n in refused},
    }


def reference_run(name: str) -> dict[str, Any]:
    """One process, the whole batch, the sampler's order (seed 7), the model's own loss."""
    model = make_model(name)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(7)).tolist()
    data = LMData()
    losses = []
    for step in range(STEPS):
        idx = order[step * BATCH : (step + 1) * BATCH]
        ids = torch.stack([data[i]["input_ids"] for i in idx])
        labels = torch.stack([data[i]["labels"] for i in idx])
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "params": {n: p.detach() for n, p in model.named_parameters()}}
