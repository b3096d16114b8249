"""ZeRO-3 rank-side checks: tied weights, a module called twice, frozen layers, HF model,
rank divergence."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import slipstream
from slipstream.models import GPT, GPTConfig

STEPS = 3


class TwiceGPT(nn.Module):
    """Tied embeddings, block 0 applied twice, block 1 frozen."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = GPT(GPTConfig.preset("tiny", tie_embeddings=True))
        for p in self.gpt.layers[1].parameters():
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        g = self.gpt
        h = g.embed_tokens(x)
        t = x.shape[1]
        cos, sin = g.rope_cos[:t], g.rope_sin[:t]
        for block in (g.layers[0], g.layers[0], g.layers[1]):
            h = block(h, cos, sin)
        logits = g.lm_head(g.norm(h))
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def _twice() -> TwiceGPT:
    torch.manual_seed(0)
    return TwiceGPT()


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


def _batches(world: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        t = torch.randint(0, 256, (2 * world, 17), generator=g)
        out.append([(t[2 * r : 2 * r + 2, :-1], t[2 * r : 2 * r + 2, 1:]) for r in range(world)])
    return out


def _loss(kind: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return model(x, y) if kind.startswith("twice") else model(input_ids=x, labels=y).loss


def reference(kind: str, world: int) -> dict[str, torch.Tensor]:
    model = _twice() if kind == "twice" else _llama()
    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.01
    )
    for step in _batches(world):
        loss = sum(_loss(kind, model, x, y) for x, y in step) / len(step)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _build(kind: str) -> tuple[nn.Module, int]:
    """The model and the most parameter elements zero.Init held at once (0 without it)."""
    if kind == "twice_init":  # sharded construction: parameters never exist in full
        with slipstream.zero.Init() as ctx:
            model = _twice()
        assert all(p.numel() == 0 and p.ds_tensor.numel() > 0 for p in model.parameters())
        return model, ctx.peak_numel
    return (_twice() if kind == "twice" else _llama()), 0


def engine_params(kind: str) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model, init_peak = _build(kind)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "gradient_clipping": 0.0,  # the single-process AdamW reference does not clip
    }
    engine, opt, _, _ = slipstream.initialize(model=model, config=config)
    total = sum(p.ds_numel for p in model.parameters() if p.requires_grad)
    every = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters())
    largest = max(p.ds_numel for p in model.parameters() if p.requires_grad)
    shard = sum(s.numel() for s in opt.store.shards)
    for step in _batches(world):
        x, y = step[rank]
        engine.backward(_loss(kind, engine, x, y))
        engine.step()
    with slipstream.zero.GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    relay_peak = opt.store.materialize_peak_numel
    engine.destroy()
    return {
        "params": params,
        "shard_numel": shard,
        "total_numel": total,
        "peak_numel": init_peak,
        "relay_peak_numel": relay_peak,
        "largest_numel": largest,
        "all_numel": every,
    }


def diverge() -> str:
    class Skippy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

        def forward(self, x: torch.Tensor, skip: bool) -> torch.Tensor:
            for i, layer in enumerate(self.layers):
                if not (skip and i == 1):
                    x = layer(x)
            return x.square().mean()

    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine, _, _, _ = slipstream.initialize(model=Skippy(), config=config)
    try:
        engine(torch.ones(2, 8), dist.get_rank() == 1)
    except RuntimeError as e:
        return str(e)
    return "no error"


def all_checks(tmp: str) -> dict[str, Any]:
    return {
        "twice": engine_params("twice"),
        "twice_init": engine_params("twice_init"),
        "llama": engine_params("llama"),
        "diverge": diverge(),
        "estimates": estimates(),
        "export": save_and_generate(tmp),
        "guard": state_dict_guard(),
    }


def estimates() -> dict[str, Any]:
    """Runtime model-state bytes vs estimate_memory for stages 0-3, fp32 and bf16."""
    out = {}
    for stage in (0, 1, 2, 3):
        for bf16 in (False, True):
            model = GPT(GPTConfig.preset("tiny"))
            est = slipstream.zero.estimate_memory(
                model, dist.get_world_size(), stage, param_dtype=torch.bfloat16 if bf16 else None
            )
            config = {
                "train_micro_batch_size_per_gpu": 2,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
                "bf16": {"enabled": bf16},
            }
            engine, opt, _, _ = slipstream.initialize(model=model, config=config)
            x = torch.randint(0, 256, (2, 16))
            engine.backward(engine(x, x))
            engine.step()
            if stage == 3:
                params = sum(s.numel() * s.element_size() for s in opt.store.shards)
            else:
                params = sum(p.numel() * p.element_size() for p in engine.module.parameters())
            held = {
                "params": params,
                "grads": opt.reducer.grad_bytes(),
                "master": opt.master_bytes(),
                "optimizer": opt.state_bytes(),
            }
            engine.destroy()
            out[(stage, bf16)] = (est, held)
    return out


def save_and_generate(tmp: str) -> dict[str, Any]:
    """save_16bit_model writes every weight (gathered unit by unit) and gathered_for_generation
    gives full weights for a generation loop."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny"))
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.0}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine, _, _, _ = slipstream.initialize(model=model, config=config)
    engine.save_16bit_model(tmp)
    with engine.gathered_for_generation() as module:
        tokens = module.generate(torch.zeros(1, 1, dtype=torch.long), 5, temperature=0.0)
    engine.destroy()
    torch.manual_seed(0)
    ref = GPT(GPTConfig.preset("tiny"))
    ref_tokens = ref.generate(torch.zeros(1, 1, dtype=torch.long), 5, temperature=0.0)
    return {"full": full, "tokens": tokens, "ref_tokens": ref_tokens}


def state_dict_guard() -> dict[str, Any]:
    """state_dict() of a partitioned model gives DeepSpeed's empty placeholders and warns with
    directions; inside GatheredParameters it gives the values."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny"))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.0}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine, _, _, _ = slipstream.initialize(model=model, config=config)
    import logging

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("slipstream").addHandler(handler)
    try:
        empty = {k: v.numel() for k, v in engine.module.state_dict().items()}
    finally:
        logging.getLogger("slipstream").removeHandler(handler)
    with slipstream.zero.GatheredParameters(list(engine.module.parameters())):
        full = {k: v.clone() for k, v in engine.module.state_dict().items()}
    engine.destroy()
    return {"warning": " ".join(records), "empty": empty, "n": len(full)}
