"""Per-rank bodies of the LoRA and frozen-model-offload checks (2 gloo ranks, run inside the
one RLHF world of tests/rlhf/conftest.py)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from tests.rlhf._hybrid_workloads import config, full_params, prompts, tiny_llama

LORA_DIM = 4


def lora_llama(seed: int = 0, only_lora: bool = True) -> nn.Module:
    """The hybrid tests' tiny LLaMA with rank-4 adapters on every decoder linear layer and
    nonzero B (so the adapters change the output and a fuse that went wrong would show)."""
    from slipstream.models.lora import LoRALinear
    from slipstream.rlhf import LoRAPolicy, apply_lora_policy_

    model = tiny_llama(seed)
    apply_lora_policy_(model, LoRAPolicy(dim=LORA_DIM, scaling=8.0, only_optimize_lora=only_lora))
    g = torch.Generator().manual_seed(seed + 11)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_b.copy_(torch.randn(m.lora_b.shape, generator=g) * 0.2)
    return model


def _record_fused(module: nn.Module) -> list[bool]:
    """Whether the first adapter layer was fused at each of its forwards."""
    from slipstream.models.lora import LoRALinear

    seen: list[bool] = []
    layer = next(m for m in module.modules() if isinstance(m, LoRALinear))
    layer.register_forward_hook(lambda m, args, out: seen.append(bool(m.fused)))
    return seen


def _lora_train_step(engine: Any, seed: int) -> None:
    from tests.rlhf._hybrid_workloads import train_step

    train_step(engine, seed)


def generation_checks() -> dict[str, Any]:
    """ZeRO-3: fused-LoRA generation (pinned) and unfused per-layer generation (unpinned)
    against the unfused, unsharded model; which parameters the optimizer holds."""
    import slipstream
    from slipstream.distributed import comm
    from slipstream.inference import generate
    from slipstream.models.lora import LoRALinear, lora_parameters
    from slipstream.rlhf import HybridEngine
    from slipstream.zero.param import full_numel

    rank = comm.get_rank()
    model = lora_llama()
    reference = copy.deepcopy(model).eval()  # adapters unfused: x W^T + s x A^T B^T
    without_adapters = tiny_llama().eval()
    engine, *_ = slipstream.initialize(model=model, config=config(3))
    ids, mask = prompts(rank)
    new = 6 + 4 * rank
    out: dict[str, Any] = {
        "want": generate(reference, input_ids=ids, attention_mask=mask, max_new_tokens=new),
        "no_lora": generate(
            without_adapters, input_ids=ids, attention_mask=mask, max_new_tokens=new
        ),
    }
    fused_at_forward = _record_fused(engine.module)
    engine.eval()
    out["pinned"] = engine.generate(ids, attention_mask=mask, max_new_tokens=new)
    out["pinned_fused"] = list(fused_at_forward)
    fused_at_forward.clear()
    unpinned_cfg = engine.config.hybrid_engine.model_copy(update={"pin_parameters": False})
    out["unpinned"] = HybridEngine(engine, unpinned_cfg).generate(
        ids, attention_mask=mask, max_new_tokens=new
    )
    out["unpinned_fused"] = list(fused_at_forward)
    engine.train()
    out["unfused_after"] = all(
        not m.fused and m._base is None
        for m in engine.module.modules()
        if isinstance(m, LoRALinear)
    )
    opt = engine.optimizer
    out["trained"] = sorted(n for n, p in engine.module.named_parameters() if opt.trains(p))
    out["lora_names"] = sorted(n for n, _ in lora_parameters(engine.module))
    out["lora_numel"] = sum(full_numel(p) for _, p in lora_parameters(engine.module))
    _lora_train_step(engine, 1)
    out["state_numel"] = sum(
        t.numel() for s in opt.state.values() for t in s.values() if t.dim() > 0
    )
    return out


def round_trip_checks(stage: int, only_lora: bool, persistence: int = 0) -> dict[str, Any]:
    """Two LoRA engines, one with 3 fused generate/train cycles between two training steps:
    same parameters after. With ``only_lora`` the frozen base weights are whole on every rank
    (slipstream's ZeRO-3 partitions trainable parameters only), so the fuse edits the real
    weights; without it they are partitioned and the fuse edits gathered copies, which
    ``persistence`` > 0 keeps gathered for good (small units): either way the unfused weights
    must be put back."""
    import slipstream
    from slipstream.distributed import comm

    rank = comm.get_rank()
    cfg = config(stage)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = persistence
    plain, *_ = slipstream.initialize(model=lora_llama(only_lora=only_lora), config=cfg)
    cycled, *_ = slipstream.initialize(model=lora_llama(only_lora=only_lora), config=cfg)
    _lora_train_step(plain, 1)
    _lora_train_step(cycled, 1)
    ids, mask = prompts(rank)
    fused = _record_fused(cycled.module)
    for i in range(3):
        cycled.eval()
        cycled.generate(ids, attention_mask=mask, max_new_tokens=3 + i)
        cycled.train()
    _lora_train_step(plain, 2)
    _lora_train_step(cycled, 2)
    return {"plain": full_params(plain), "cycled": full_params(cycled), "fused": fused}


def ppo_checks() -> dict[str, Any]:
    """Two PPO steps with a LoRA actor and a LoRA critic (ZeRO-3, only adapters and v_head
    trained) and the reference and reward models host-resident (offload_frozen_): the
    adapters move, the frozen base weights and models stay bit-for-bit."""
    import slipstream
    from slipstream.distributed import comm
    from slipstream.models.lora import LoRALinear
    from slipstream.rlhf import (
        LoRAPolicy,
        PPOConfig,
        PPOTrainer,
        RewardModel,
        apply_lora_policy_,
        offload_frozen_,
    )

    rank = comm.get_rank()
    actor_model = lora_llama()
    start = {n: p.detach().clone() for n, p in actor_model.named_parameters()}
    reference_model = tiny_llama()  # the SFT model (the actor before its adapters)
    reference_start = {n: p.detach().clone() for n, p in reference_model.named_parameters()}
    critic_model = RewardModel(tiny_llama(1))
    apply_lora_policy_(
        critic_model,
        LoRAPolicy(dim=LORA_DIM, only_optimize_lora=True, force_optimize=("v_head.weight",)),
    )
    cfg = config(3)
    cfg["hybrid_engine"]["max_out_tokens"] = 24
    actor, *_ = slipstream.initialize(model=actor_model, config=cfg)
    critic_cfg = config(3)
    del critic_cfg["hybrid_engine"]
    critic, *_ = slipstream.initialize(model=critic_model, config=critic_cfg)
    trained_critic = sorted(
        n for n, p in critic.module.named_parameters() if critic.optimizer.trains(p)
    )
    reference = reference_model.requires_grad_(False)
    reward = RewardModel(tiny_llama(2)).requires_grad_(False)
    offloads = [offload_frozen_(m, device="cpu") for m in (reference, reward)]
    trainer = PPOTrainer(actor, critic, reference, reward, PPOConfig(max_new_tokens=5))
    ids, mask = prompts(rank)
    metrics = [trainer.step(ids, mask) for _ in range(2)]
    now = full_params(actor)
    lora = [n for n in now if n.endswith(("lora_a", "lora_b"))]
    frozen_now = dict(reference.named_parameters())
    return {
        "metrics": metrics,
        "trained_critic": trained_critic,
        "lora_moved": max(float((now[n] - start[n]).abs().max()) for n in lora),
        "base_kept": all(torch.equal(now[n], start[n]) for n in now if n not in lora),
        "reference_kept": all(torch.equal(frozen_now[n], reference_start[n]) for n in frozen_now),
        "fetches": [o.fetches for o in offloads],
        "unfused": all(not m.fused for m in actor.module.modules() if isinstance(m, LoRALinear)),
    }


# The checks this file adds to the RLHF world (tests/rlhf/_hybrid_workloads.all_checks).
CHECKS = {
    "lora_gen": generation_checks,
    "lora_trip3": lambda: round_trip_checks(3, only_lora=True),
    "lora_trip3_full": lambda: round_trip_checks(3, only_lora=False, persistence=10_000),
    "lora_trip2": lambda: round_trip_checks(2, only_lora=True),
    "lora_ppo": ppo_checks,
}


def chat_step3_with_lora(directory: str) -> dict[str, Any]:
    """``slipstream chat --step 3`` (one rank) from a saved reference GPT and a saved reward
    model, with LoRA on actor and critic (adapters only) and both frozen models offloaded.
    Returns the saved models' states before and after."""
    import json
    from pathlib import Path

    from slipstream.rlhf import RewardModel
    from slipstream.rlhf.e2e import CharTokenizer, ChatOptions, run_chat, save_model
    from slipstream.rlhf.model_files import _gpt_from_preset
    from tests.rlhf._chat_workloads import records

    root = Path(directory)
    rows = [{"prompt": r.prompt[1:], "chosen": r.chosen[1:], "rejected": r.rejected[1:]}
            for r in records(20, seed=5)]  # fmt: skip
    (root / "data").mkdir()
    (root / "data" / "train.json").write_text(json.dumps(rows))
    tok = CharTokenizer(" 0123456789:")
    save_model(_gpt_from_preset("gpt:tiny", tok, 16, 0), tok, root / "sft")
    save_model(RewardModel(_gpt_from_preset("gpt:tiny", tok, 16, 1)), tok, root / "rm")
    opts = ChatOptions(
        actor=str(root / "sft"), reward=str(root / "rm"), data=str(root / "data"),
        output=str(root / "out"), step="3", batch_size=2, max_seq_len=12, max_prompt_len=6,
        max_answer_len=4, actor_lr=1e-2, critic_lr=1e-2, actor_lora_dim=4,
        critic_lora_dim=4, only_optimize_lora=True, offload_reference_model=True,
        offload_reward_model=True,
    )  # fmt: skip
    summary = run_chat(opts)

    from tests.rlhf._chat_workloads import saved_state as state

    out = root / "out" / "step3_rlhf"
    return {
        "summary": summary,
        "ppo_rows": len((out / "ppo.jsonl").read_text().splitlines()),
        "sft": state(root / "sft"),
        "rm": state(root / "rm"),
        "actor": state(out / "actor"),
        "critic": state(out / "critic"),
    }
