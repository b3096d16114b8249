"""AutoEP workloads: tiny Hugging Face MoE models built from configs (Mixtral, Qwen3-MoE,
Qwen3.5-MoE, DeepSeek-V2, DeepSeek-V3, MiniMax-M3), converted by the ``expert_parallel`` block, against the unconverted
model in the same process."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

VOCAB, STEPS, LR = 64, 3, 0.05
_SMALL = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 64,
}
_MLA = {
    "moe_intermediate_size": 24,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 8,
    "n_shared_experts": 1,
}


def build(preset: str, seed: int = 0, **overrides: Any) -> nn.Module:
    """A tiny model of ``preset``'s family with spread-out router and expert weights."""
    import transformers as t

    torch.manual_seed(seed)
    if preset == "mixtral":
        cfg: Any = t.MixtralConfig(**_SMALL, num_local_experts=4, num_experts_per_tok=2)
        model = t.MixtralForCausalLM(cfg)
    elif preset == "qwen3_moe":
        cfg = t.Qwen3MoeConfig(
            **_SMALL, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
            norm_topk_prob=True, mlp_only_layers=[],
        )  # fmt: skip
        model = t.Qwen3MoeForCausalLM(cfg)
    elif preset == "qwen3_5_moe":  # the text backbone, full attention only (cheaper)
        cfg = t.Qwen3_5MoeTextConfig(
            **_SMALL, moe_intermediate_size=24, shared_expert_intermediate_size=24,
            num_experts=4, num_experts_per_tok=2, head_dim=8,
            layer_types=["full_attention", "full_attention"],
        )  # fmt: skip
        model = t.Qwen3_5MoeForCausalLM(cfg)
    elif preset == "minimax_m3":  # the text backbone: a dense first layer, then MoE
        cfg = t.MiniMaxM3VLTextConfig(
            **_SMALL, num_local_experts=4, num_experts_per_tok=2, head_dim=8,
            shared_intermediate_size=24, dense_intermediate_size=48,
            mlp_layer_types=["dense", "sparse"], bos_token_id=None, eos_token_id=None,
        )  # fmt: skip
        model = t.MiniMaxM3VLForCausalLM(cfg)
    elif preset == "deepseek_v2":
        cfg = t.DeepseekV2Config(**_SMALL, **_MLA, n_routed_experts=4, num_experts_per_tok=2)
        model = t.DeepseekV2ForCausalLM(cfg)
    else:
        cfg = t.DeepseekV3Config(
            **_SMALL, **_MLA, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
            topk_group=1, routed_scaling_factor=2.5,
        )  # fmt: skip
        model = t.DeepseekV3ForCausalLM(cfg)
    for name, v in overrides.items():
        setattr(model.config, name, v)
    with torch.no_grad():
        for mod in model.modules():
            for name, p in mod.named_parameters(recurse=False):
                if p.dim() == 3 or (name == "weight" and "Router" in type(mod).__name__):
                    nn.init.normal_(p, std=0.3 if p.dim() == 2 else 0.1)
            bias = getattr(mod, "e_score_correction_bias", None)
            if isinstance(bias, torch.Tensor):
                bias.normal_(0, 0.05)
    return model.float()


def batch(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randint(0, VOCAB, (2, 8), generator=g)


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def expert_slices(
    ref: dict[str, torch.Tensor], rank: int, ep: int, names: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``ref`` cut to this expert-parallel rank's experts where ``names`` holds fewer."""
    out = {}
    for n, t in names.items():
        r = ref[n]
        if r.shape != t.shape:
            local = t.shape[0]
            r = r[(rank % ep) * local : (rank % ep + 1) * local]
        out[n] = r
    return out


def engine_vs_reference(preset: str, ep: int, stage: int) -> dict[str, Any]:
    """slipstream.initialize with ``expert_parallel`` at ``autoep_size=ep``: first logits
    against the unconverted model, then 3 SGD steps (clipped) against one process training
    the unconverted model on the mean of the ranks' losses."""
    import slipstream
    from slipstream.moe.autoep import AutoEPExperts

    rank, world = dist.get_rank(), dist.get_world_size()
    ref = build(preset)
    model = build(preset)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 1.0,
        "expert_parallel": {"enabled": True, "autoep_size": ep, "preset_model": preset},
    }
    engine, _, _, _ = slipstream.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    converted = sum(isinstance(m, AutoEPExperts) for m in engine.module.modules())
    with torch.no_grad():
        first = engine(input_ids=batch(rank, 0)).logits
        first_ref = ref(input_ids=batch(rank, 0)).logits
    losses = []
    for step in range(STEPS):
        loss = _loss(engine, batch(rank, step))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9)
    ref_losses = []
    for step in range(STEPS):
        per_rank = [_loss(ref, batch(r, step)) for r in range(world)]
        ref_losses.append(float(per_rank[rank]))
        (sum(per_rank) / world).backward()
        nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    ref_params = {n: p.detach().clone() for n, p in ref.named_parameters()}
    engine.destroy()
    return {
        "converted": converted,
        "first": first,
        "first_ref": first_ref,
        "losses": losses,
        "ref_losses": ref_losses,
        "params": params,
        "ref_params": expert_slices(ref_params, rank, ep, params),
    }


def trainer_losses(workdir: str, autoep: bool) -> tuple[list[float], int]:
    """The HF Trainer (``TrainingArguments(deepspeed=config)``) on a tiny Mixtral, with the
    ``expert_parallel`` block at ``autoep_size`` 2 or without it."""
    from transformers import Trainer, TrainingArguments

    auto = "auto"
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": auto,
        "train_batch_size": auto,
        "gradient_accumulation_steps": auto,
        "gradient_clipping": auto,
        "optimizer": {"type": "AdamW", "params": dict.fromkeys(("lr", "betas", "eps"), auto)},
        "zero_optimization": {"stage": 2},
    }
    if autoep:
        config["expert_parallel"] = {"enabled": True, "autoep_size": 2}
    args = TrainingArguments(
        output_dir=os.path.join(workdir, f"autoep{int(autoep)}"),
        deepspeed=config,
        max_steps=3,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        use_cpu=True,
        disable_tqdm=True,
    )
    model = build("mixtral")
    g = torch.Generator().manual_seed(3)
    data = [{"input_ids": x, "labels": x} for x in torch.randint(0, VOCAB, (12, 8), generator=g)]
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    from slipstream.moe.autoep import AutoEPExperts

    module = getattr(trainer.model_wrapped, "module", trainer.model_wrapped)
    converted = sum(isinstance(m, AutoEPExperts) for m in module.modules())
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], converted


def world(workdir: str) -> dict[str, Any]:
    """Everything the 2-rank tests check, in one forked world."""
    out: dict[str, Any] = {}
    for preset in ("qwen3_moe", "deepseek_v3"):  # ZeRO-1; Mixtral at ZeRO-2 below
        out[f"{preset}/ep2"] = engine_vs_reference(preset, 2, 1)
    out["mixtral/ep2/zero2"] = engine_vs_reference("mixtral", 2, 2)
    out["trainer"] = {ep: trainer_losses(workdir, ep) for ep in (False, True)}
    return out
