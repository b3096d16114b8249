"""Rank bodies for the tiled MLP / tiled loss / HF cpu_checkpointing tests."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tests.sequence import _hf_workloads as w

# (model, ZeRO stage) at SP=2 with every memory switch on (ZeRO-3: the parameters are
# gathered only inside their unit's forward and backward, the hardest case for tiling).
RUNS = [("llama_gqa2", 3)]
TILED = {"mlp": True, "mlp_shards": 3, "logits_loss": True, "logits_loss_shards": "auto"}


def _engine_run(name: str, stage: int, sp: int) -> dict[str, Any]:
    import slipstream

    model = w.make_model(name)
    model.gradient_checkpointing_enable()
    config = {
        **w._config(stage, sp),
        "tiled_compute": TILED,
        "activation_checkpointing": {"cpu_checkpointing": True},
    }
    engine, _, loader, _ = slipstream.initialize(
        model=model, config=config, training_data=w.LMData()
    )
    losses, logits = [], set()
    for _, batch in zip(range(w.STEPS), loader):
        out = engine(**batch)
        logits.add(out.logits is None)
        engine.backward(out.loss)
        engine.step()
        losses.append(float(out.loss.detach()))
    with slipstream.zero.GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    checkpoint_fn = engine.module.model.layers[0]._gradient_checkpointing_func
    engine.destroy()
    return {
        "losses": losses,
        "params": params,
        "logits_none": sorted(logits),
        "bound": getattr(checkpoint_fn, "__name__", ""),
    }


def world(runs: list[tuple[str, int]]) -> dict[str, Any]:
    return {run: _engine_run(*run, dist.get_world_size()) for run in runs}


def reference(name: str) -> dict[str, Any]:
    return w.reference_run(name)


__all__ = ["RUNS", "reference", "torch", "world"]
