"""Rank-side part of the FLOPs profiler engine test."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import slipstream
from slipstream.distributed import comm
from slipstream.models import GPT, GPTConfig


def profiled_training(out_dir: str) -> dict[str, Any]:
    """Three ZeRO-2 steps with the flops_profiler block on; what rank 0 and 1 report."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", num_kv_heads=None))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2},
        # The three observability blocks of a DeepSpeed config, together, as DeepSpeed spells them.
        "tensorboard": {"enabled": True, "output_path": out_dir, "job_name": "tb"},
        "csv_monitor": {"enabled": True, "output_path": out_dir, "job_name": "csv"},
        "flops_profiler": {
            "enabled": True,
            "profile_step": 1,
            "output_file": str(Path(out_dir) / "profile.txt"),
        },
    }
    engine, *_ = slipstream.initialize(model=model, config=config)
    g = torch.Generator().manual_seed(comm.get_rank())
    for _ in range(3 * 2):
        t = torch.randint(0, model.config.vocab_size, (2, 17), generator=g)
        loss = engine(t[:, :-1], t[:, 1:])
        engine.backward(loss)
        engine.step()
    prof = engine.flops_profiler
    result = {
        "profiled": prof is not None,
        "flops_per_step": None if prof is None else prof.flops_per_step,
        "report": None if prof is None else prof.mfu_report(2, 1.0),
        "config": model.config,
    }
    engine.destroy()
    return result
