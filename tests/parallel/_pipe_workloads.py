"""Rank bodies and single-process references for the pipeline-parallel tests."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import slipstream
from slipstream.distributed.comm import comm_counters
from slipstream.distributed.mesh import dp_group
from slipstream.models import GPT, GPTConfig
from slipstream.models.gpt_pipeline import (
    gpt_loss,
    gpt_parameter_name,
    gpt_pipeline_layers,
    load_gpt_weights_,
)
from slipstream.parallel.tensor import is_tp_sharded, unshard_tp
from slipstream.pipe import PipelineModule
from slipstream.zero import GatheredParameters

VOCAB, SEQ, MICRO, STEPS, LAYERS = 64, 16, 2, 5, 6
LR = 0.1
# SGD with momentum, not Adam: Adam's invariance to gradient scale would hide a wrong sum of
# tied gradients or a wrong 1/micro-batches factor.


def gpt_config(tie: bool = False) -> GPTConfig:
    return GPTConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_layers=LAYERS,
        num_heads=4,
        num_kv_heads=2,
        max_seq_len=SEQ,
        tie_embeddings=tie,
    )


def reference_model(tie: bool = False) -> GPT:
    torch.manual_seed(0)
    return GPT(gpt_config(tie))


def global_batches(batch: int, steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=g)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def reference_run(
    micro_batches: int, dp: int, tie: bool = False, clip: float = 0.0
) -> dict[str, Any]:
    """Plain single-process training on the same global batches."""
    model = reference_model(tie)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for x, y in global_batches(MICRO * micro_batches * dp):
        loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return {
        "losses": losses,
        "params": {n: p.detach().clone() for n, p in model.state_dict().items()},
    }


def micro_iter(micro_batches: int, dp: int, dp_rank: int) -> Any:
    """This data-parallel rank's micro-batches of every step, in order."""
    for x, y in global_batches(MICRO * micro_batches * dp):
        for i in range(micro_batches):
            lo = (i * dp + dp_rank) * MICRO
            yield x[lo : lo + MICRO], y[lo : lo + MICRO]


def pipeline_run(
    pp: int,
    schedule: str,
    micro_batches: int,
    virtual: int = 1,
    stage: int = 1,
    tie: bool = False,
    ckpt: int = 0,
    steps: int = STEPS,
    tp: int = 1,
    partitioned: bool = True,
    clip: float = 0.0,
    precision: str | None = None,
) -> dict[str, Any]:
    """Train the pipeline GPT through slipstream.initialize; this stage's GPT-named params."""
    module = PipelineModule(
        gpt_pipeline_layers(gpt_config(tie)),
        num_stages=pp,
        loss_fn=gpt_loss,
        virtual_stages=virtual,
        activation_checkpoint_interval=ckpt,
    )
    load_gpt_weights_(module, reference_model(tie).state_dict(), LAYERS)
    dp = dist.get_world_size() // (pp * tp)
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": micro_batches,
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
        "gradient_clipping": clip,
        # ZeRO-3: shard every layer (tiny layers would otherwise stay whole, "persistent")
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "pipeline": {
            "schedule": schedule,
            "virtual_stages": virtual,
            "pipe_partitioned": partitioned,
            "grad_partitioned": partitioned,
        },
        "tensor_parallel": {"autotp_size": tp},
    }
    if precision is not None:
        config[precision] = {"enabled": True}
    engine, *_ = slipstream.initialize(model=module, config=config)
    dp_rank = dist.get_rank(dp_group(engine.mesh))
    it = micro_iter(micro_batches, dp, dp_rank)
    comm_counters.stats.clear()
    losses = [engine.train_batch(it).item() for _ in range(steps)]
    pp_send_bytes = comm_counters.stats[("pp", "send")].bytes
    released = sum(p.untyped_storage().size() == 0 for p in module.parameters())
    tp_group = engine.mesh.get_group("tp")
    with GatheredParameters(list(module.parameters())):  # ZeRO-3: full values (else no-op)
        params = {
            gpt_parameter_name(n, LAYERS): unshard_tp(p, tp_group).clone()
            for n, p in module.named_parameters()
        }
    sharded = [
        gpt_parameter_name(n, LAYERS) for n, p in module.named_parameters() if is_tp_sharded(p)
    ]
    stats = engine.activation_stats
    engine.destroy()
    return {
        "losses": losses,
        "params": params,
        "tp_sharded": sharded,
        "pp_send_bytes": pp_send_bytes,
        "released": released,  # ZeRO-3: parameters whose full storage is freed between uses
        "num_params": len(list(module.parameters())),
        "peak_in_flight": stats.peak_in_flight,
        "peak_bytes": stats.peak_bytes,
    }


def starved_run() -> str:
    """PP=2 where stage 0's data iterator is empty: every rank must raise, none may hang."""
    module = PipelineModule(gpt_pipeline_layers(gpt_config()), num_stages=2, loss_fn=gpt_loss)
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
    }
    engine, *_ = slipstream.initialize(model=module, config=config)
    it = iter([]) if dist.get_rank() == 0 else micro_iter(2, 1, 0)
    try:
        engine.train_batch(it)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    finally:
        engine.destroy()
    return "no error"


def _tied_linear_weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {n: torch.randn(shape, generator=g) * 0.3 for n, shape in TIED_LINEAR_SHAPES.items()}


TIED_LINEAR_SHAPES = {
    "lin.weight": (8, 8),
    "lin.bias": (8,),
    "mid.weight": (8, 8),
    "mid.bias": (8,),
}


def _tied_linear_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(12)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)) for _ in range(6)]


def tied_linear_reference() -> list[float]:
    """x -> lin -> tanh -> mid -> lin (the same weight *and* bias twice), MSE, SGD, on the
    global batch of two micro-batches per step."""
    w = {n: t.clone().requires_grad_(True) for n, t in _tied_linear_weights().items()}
    opt = torch.optim.SGD(list(w.values()), lr=LR)
    data, losses = _tied_linear_batches(), []
    for step in range(3):
        x = torch.cat([data[2 * step][0], data[2 * step + 1][0]])
        y = torch.cat([data[2 * step][1], data[2 * step + 1][1]])
        h = torch.nn.functional.linear(x, w["lin.weight"], w["lin.bias"]).tanh()
        h = torch.nn.functional.linear(h, w["mid.weight"], w["mid.bias"])
        out = torch.nn.functional.linear(h, w["lin.weight"], w["lin.bias"])
        loss = ((out - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def tied_linear_run() -> list[float]:
    """The same on PP=2: the tied Linear (weight and bias) sits on both stages."""
    from torch import nn

    from slipstream.pipe import LayerSpec, TiedLayerSpec

    def tied() -> TiedLayerSpec:
        return TiedLayerSpec("lin", nn.Linear, 8, 8, tied_weight_attr=["weight", "bias"])

    layers = [tied(), LayerSpec(nn.Tanh), LayerSpec(nn.Linear, 8, 8), tied()]
    module = PipelineModule(
        layers,
        num_stages=2,
        loss_fn=lambda out, y: ((out - y) ** 2).mean(),
        partition_method="uniform",
    )
    weights = _tied_linear_weights()
    with torch.no_grad():
        for name, p in module.named_parameters():
            key = name.replace("tied_modules.", "").replace("2.", "mid.")
            p.copy_(weights[key])
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "gradient_clipping": 0.0,  # the torch reference does not clip
    }
    engine, *_ = slipstream.initialize(model=module, config=config)
    data = iter(_tied_linear_batches())
    losses = [engine.train_batch(data).item() for _ in range(3)]
    engine.destroy()
    return losses
