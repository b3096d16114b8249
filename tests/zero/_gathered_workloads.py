"""Rank side of tests/zero/test_gathered_values.py."""

from __future__ import annotations

import io
from typing import Any

import torch

import slipstream
from slipstream.models import GPT, GPTConfig
from slipstream.zero import GatheredParameters


def taken_inside_stay_valid() -> dict[str, Any]:
    """DeepSpeed-Chat's save_zero_three_model: ``v.data.cpu()`` inside GatheredParameters,
    used after the block (and after the unit is gathered and released again)."""
    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.0}},  # values stay put
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = slipstream.initialize(model=GPT(GPTConfig.preset("tiny")), config=config)
    taken, copies = {}, {}
    for name, p in engine.module.named_parameters():
        with GatheredParameters([p]):
            taken[name] = p.data.cpu()  # the same tensor on the CPU: no copy
            copies[name] = p.data.clone()
    x = torch.randint(0, 256, (2, 8))
    engine.backward(engine(x, x))  # gathers and releases every unit again
    engine.step()
    buf = io.BytesIO()
    torch.save(taken, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    engine.destroy()
    return {
        "equal": all(torch.equal(taken[n], copies[n]) for n in copies),
        "loaded": all(torch.equal(loaded[n], copies[n]) for n in copies),
        "n": len(copies),
    }


def init_model_for_inference_in_bf16() -> dict[str, Any]:
    """A zero.Init (fp32) model initialized without an optimizer under a bf16 config (a
    reference model in RLHF): gathered in full, every parameter in bf16."""
    torch.manual_seed(0)
    with slipstream.zero.Init():
        model = GPT(GPTConfig.preset("tiny"))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3},
    }
    engine, *_ = slipstream.initialize(model=model, config=config)
    x = torch.randint(0, 256, (2, 8))
    with torch.no_grad():
        loss = engine(x, x)
    return {
        "dtypes": sorted({str(p.dtype) for p in engine.module.parameters()}),
        "loss": float(loss),
    }
