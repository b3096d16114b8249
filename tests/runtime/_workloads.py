"""Rank-side checks for the engine tests, bundled so one spawned world runs them all."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import slipstream
from slipstream.models import GPT, GPTConfig


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.preset("tiny"))


def _batch(rank: int, n: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    t = torch.randint(0, 256, (n, 17), generator=g)
    return t[:, :-1], t[:, 1:]


def fp16_overflow() -> dict[str, Any]:
    """Inject inf on rank 1 at step 2: both ranks skip the step and lower the scale."""
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 1},
        "fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1},
    }
    engine, opt, _, _ = slipstream.initialize(model=_model(), config=config)
    x, y = _batch(dist.get_rank())
    out: dict[str, Any] = {
        "dtype": str(next(engine.module.parameters()).dtype),
        "scales": [],
        "applied": [],
    }
    for step in range(3):
        loss = engine(x, y)
        if step == 1 and dist.get_rank() == 1:
            loss = loss * float("inf")
        before = [p.detach().clone() for p in engine.module.parameters()]
        engine.backward(loss)
        engine.step()
        changed = any(not torch.equal(b, p) for b, p in zip(before, engine.module.parameters()))
        out["scales"].append(opt.loss_scale)
        out["applied"].append((engine.was_step_applied(), changed))
    out["skipped"] = engine.skipped_steps
    out["global_steps"] = engine.global_steps
    engine.destroy()
    return out


def api_and_errors() -> dict[str, Any]:
    """Engine introspection, client optimizer/scheduler, and the clear errors."""
    out: dict[str, Any] = {}
    model = _model()
    client = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(client, step_size=1, gamma=0.5)
    engine, opt, _, lr_sched = slipstream.initialize(
        model=model,
        optimizer=client,
        lr_scheduler=sched,
        config={
            "train_batch_size": 8,
            "gradient_accumulation_steps": 2,
            "zero_optimization": {"stage": 2},
        },
    )
    out["triple"] = (
        engine.train_batch_size(),
        engine.train_micro_batch_size_per_gpu(),
        engine.gradient_accumulation_steps(),
    )
    out["same_optimizer_object"] = opt.optimizer is client and lr_sched is sched
    x, y = _batch(dist.get_rank())
    boundaries, lrs = [], []
    for _ in range(4):
        boundaries.append(engine.is_gradient_accumulation_boundary())
        engine.backward(engine(x, y))
        engine.step()
        lrs.append(engine.get_lr()[0])
    out["boundaries"], out["lrs"] = boundaries, lrs
    out["global_steps"], out["global_samples"] = engine.global_steps, engine.global_samples
    out["grad_norm_positive"] = (engine.get_global_grad_norm() or 0) > 0
    try:
        with engine.no_sync():
            pass
    except RuntimeError as e:
        out["no_sync_error"] = str(e)
    engine.destroy()
    # Stage 1 all-reduces on the boundary; a second backward before step() adds to the
    # reduced gradients, as DeepSpeed's stage 0 and PyTorch do: the same step as one
    # backward of the summed loss.
    after = []
    for twice in (True, False):
        engine, _, _, _ = slipstream.initialize(
            model=_model(),
            config={
                "train_micro_batch_size_per_gpu": 2,
                "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                "zero_optimization": {"stage": 1},
            },
        )
        if twice:
            engine.backward(engine(x, y))
            engine.backward(engine(y, x))
        else:
            engine.backward(engine(x, y) + engine(y, x))
        engine.step()
        after.append([p.detach().clone() for p in engine.module.parameters()])
        engine.destroy()
    out["double_backward"] = after
    return out


def hf_llama() -> dict[str, Any]:
    """An HF transformers model built from a config trains through the engine at ZeRO-2."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(cfg)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"},
        "bf16": {"enabled": "auto"},
    }
    engine, _, _, _ = slipstream.initialize(model=model, config=config)
    x, _ = _batch(dist.get_rank(), n=2)
    losses = []
    for _ in range(8):
        out = engine(input_ids=x, labels=x)
        engine.backward(out.loss)
        engine.step()
        losses.append(float(out.loss.detach()))
    params = [p.detach().clone() for p in engine.module.parameters()]
    engine.destroy()
    return {
        "losses": losses,
        "bucket": engine.config.zero_optimization.reduce_bucket_size,
        "params": params,
    }


def diverged_models() -> str:
    """Ranks that build different models get an error naming the ranks, not a hang."""
    torch.manual_seed(0)
    hidden = 64 if dist.get_rank() == 0 else 32
    model = GPT(GPTConfig(hidden_size=hidden, num_layers=1, num_heads=4, max_seq_len=16))
    try:
        slipstream.initialize(
            model=model,
            config={
                "train_micro_batch_size_per_gpu": 1,
                "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            },
        )
    except RuntimeError as e:
        return str(e)
    return "no error"


def logging_and_comm_counters() -> dict[str, Any]:
    """steps_per_print / wall_clock_breakdown / comms_logger log; bytes are counted per axis."""
    import logging

    from slipstream.distributed import comm

    records: list[str] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Capture()
    logging.getLogger("slipstream").addHandler(handler)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2},
        "steps_per_print": 1,
        "wall_clock_breakdown": True,
        "comms_logger": {"enabled": True},
    }
    engine, opt, _, _ = slipstream.initialize(model=_model(), config=config)
    comm.comm_counters.reset()
    x, y = _batch(dist.get_rank())
    engine.backward(engine(x, y))
    engine.step()
    summary = comm.log_summary()
    logging.getLogger("slipstream").removeHandler(handler)
    numel = sum(b.numel for b in opt.buckets)
    engine.destroy()
    return {"records": records, "summary": summary, "bucket_bytes": numel * 4}


def precision_switches_and_manual_paths() -> dict[str, Any]:
    """bf16 master-weight switch, engine.scale + manual backward, no_sync, unmanaged accumulation."""
    out: dict[str, Any] = {}
    x, y = _batch(dist.get_rank())
    low = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2},
        "bf16": {
            "enabled": True,
            "bf16_master_weights_and_grads": True,
            "bf16_optimizer_states": True,
        },
    }
    for name, config in (("low", low), ("default", dict(low, bf16={"enabled": True}))):
        engine, opt, _, _ = slipstream.initialize(model=_model(), config=config)
        engine.backward(engine(x, y))
        engine.step()
        out[f"{name}_master_bytes"] = opt.master_bytes()
        dtypes = {str(v.dtype) for st in opt.state.values() for v in st.values() if v.dim()}
        out[f"{name}_state_dtypes"] = sorted(dtypes)
        engine.destroy()

    base = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 1},
    }
    norms = []
    for manual in (False, True):
        engine, _, _, _ = slipstream.initialize(model=_model(), config=base)
        loss = engine(x, y)
        if manual:
            engine.scale(loss).backward()
        else:
            engine.backward(loss)
        engine.step()
        norms.append(engine.get_global_grad_norm())
        engine.destroy()
    out["manual_norms"] = norms

    from slipstream.distributed import comm

    engine, _, _, _ = slipstream.initialize(model=_model(), config=base)
    comm.comm_counters.reset()
    with engine.no_sync():
        engine.backward(engine(x, y))
    engine.backward(engine(x, y))
    engine.step()
    summary = comm.log_summary()
    out["no_sync_allreduce_calls"] = summary["dp"]["all_reduce"]["calls"]
    out["no_sync_params"] = [p.detach().clone() for p in engine.module.parameters()]
    engine.destroy()

    engine, _, _, _ = slipstream.initialize(
        model=_model(),
        config=dict(base, gradient_accumulation_steps=2, managed_gradient_accumulation=False),
    )
    flags = []
    for _ in range(2):
        flags.append(engine.is_gradient_accumulation_boundary())
        engine.backward(engine(x, y))
        engine.step()
    out["unmanaged"] = (flags, engine.global_steps)
    engine.destroy()
    return out


def layerwise_and_untested_optimizers() -> dict[str, Any]:
    """Lamb is exact at stage 0 (whole-parameter views), refused where ZeRO splits parameters;
    an optimizer class of unknown kind needs zero_allow_untested_optimizer."""
    from slipstream.config import ConfigError
    from slipstream.optim import Lamb

    out: dict[str, Any] = {}
    x, y = _batch(dist.get_rank())
    lamb = {"type": "Lamb", "params": {"lr": 1e-2, "weight_decay": 0.01}}
    engine, _, _, _ = slipstream.initialize(
        model=_model(),
        # The torch-level reference below does not clip (DeepSpeed's default clips at 1.0).
        config={"train_micro_batch_size_per_gpu": 2, "optimizer": lamb, "gradient_clipping": 0.0},
    )
    for _ in range(3):
        engine.backward(engine(x, y))
        engine.step()
    out["lamb_params"] = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    # The reference: torch-level Lamb on one process over both ranks' batches.
    ref = _model()
    opt = Lamb(ref.parameters(), lr=1e-2, weight_decay=0.01)
    xs = [_batch(r) for r in range(dist.get_world_size())]
    for _ in range(3):
        loss = sum(ref(bx, by) for bx, by in xs) / len(xs)
        loss.backward()
        opt.step()
        opt.zero_grad()
    out["lamb_ref"] = {n: p.detach().clone() for n, p in ref.named_parameters()}
    try:
        slipstream.initialize(
            model=_model(),
            config={
                "train_micro_batch_size_per_gpu": 2,
                "optimizer": lamb,
                "zero_optimization": {"stage": 2},
            },
        )
        out["lamb_stage2"] = None
    except ConfigError as e:
        out["lamb_stage2"] = str(e)

    class MyOpt(torch.optim.SGD):
        pass

    class Custom(torch.optim.Optimizer):
        def __init__(self, params: Any) -> None:
            super().__init__(params, {"lr": 0.1})

        def step(self, closure: Any = None) -> None:
            for g in self.param_groups:
                for p in g["params"]:
                    if p.grad is not None:
                        p.add_(p.grad, alpha=-g["lr"])

    base = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}}
    m = _model()
    engine, _, _, _ = slipstream.initialize(
        model=m, optimizer=MyOpt(m.parameters(), lr=0.1), config=base
    )
    engine.destroy()
    m = _model()
    try:
        slipstream.initialize(model=m, optimizer=Custom(m.parameters()), config=base)
        out["custom"] = None
    except ConfigError as e:
        out["custom"] = str(e)
    m = _model()
    engine, _, _, _ = slipstream.initialize(
        model=m,
        optimizer=Custom(m.parameters()),
        config=dict(base, zero_allow_untested_optimizer=True),
    )
    engine.backward(engine(x, y))
    engine.step()
    out["custom_allowed_steps"] = engine.global_steps
    engine.destroy()
    return out


def all_checks() -> dict[str, Any]:
    return {
        "optimizers": layerwise_and_untested_optimizers(),
        "switches": precision_switches_and_manual_paths(),
        "logs": logging_and_comm_counters(),
        "fp16": fp16_overflow(),
        "api": api_and_errors(),
        "hf": hf_llama(),
        "diverged": diverged_models(),
    }
