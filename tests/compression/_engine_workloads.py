"""Training runs with ``compression_training`` on slipstream's engine and on DeepSpeed's
(any release that still ships the compression library: 0.19.6 and earlier), one rank each."""

from __future__ import annotations

import copy
from typing import Any

import torch

from tests.compression import _models as m

STEPS = 6


def _train(deepspeed: Any, cfg: dict[str, Any], compress: Any, clean: Any | None) -> dict[str, Any]:
    model = m.tiny_bert(0)
    compress(model, copy.deepcopy(cfg))
    engine, *_ = deepspeed.initialize(
        model=model, config=copy.deepcopy(cfg), model_parameters=model.parameters()
    )
    losses = []
    for step in range(STEPS):
        ids, labels = m.batch(step)
        loss = engine(ids, labels)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.eval()
    with torch.no_grad():
        eval_logits = engine(m.batch(99)[0])
    if clean is None:  # ZeRO-3 shards: nothing whole to clean
        return {"losses": losses, "eval": eval_logits}
    clean(engine.module, copy.deepcopy(cfg))
    state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    return {"losses": losses, "eval": eval_logits, "state": state}


def slipstream_run(cfg: dict[str, Any], clean: bool = True) -> dict[str, Any]:
    import slipstream
    from slipstream.compression.compress import init_compression, redundancy_clean

    return _train(slipstream, cfg, init_compression, redundancy_clean if clean else None)


def deepspeed_run(cfg: dict[str, Any]) -> dict[str, Any]:
    from tests.compat._deepspeed import import_deepspeed

    deepspeed = import_deepspeed()
    from deepspeed.compression.compress import init_compression, redundancy_clean

    return _train(deepspeed, cfg, init_compression, redundancy_clean)


def slipstream_runs(cfgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [slipstream_run(c) for c in cfgs]


def deepspeed_runs(cfgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [deepspeed_run(c) for c in cfgs]


def reference_run(cfg: dict[str, Any]) -> list[float]:
    """Plain PyTorch with DeepSpeed's schedule by hand: a check before the first forward,
    one scheduler step after each optimizer step."""
    from slipstream.compression.compress import init_compression
    from slipstream.compression.config import get_compression_config
    from slipstream.compression.scheduler import CompressionScheduler

    model = m.tiny_bert(0)
    init_compression(model, cfg)
    sched = CompressionScheduler(model, get_compression_config(cfg))
    opt = torch.optim.SGD(model.parameters(), lr=cfg["optimizer"]["params"]["lr"])
    sched.step(step_zero_check=True)
    losses = []
    for step in range(STEPS):
        ids, labels = m.batch(step)
        loss = model(ids, labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    return losses
