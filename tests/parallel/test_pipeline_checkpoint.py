"""Pipeline checkpoints reshard: saved at PP=2 x DP=2 with ZeRO-3 (every layer sharded; tied
embedding on both stages, written once), resumed at PP=4 with ZeRO-2, training continues
exactly (DeepSpeed's pipeline checkpoints load only at the same pipeline layout)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import slipstream
from slipstream.distributed.mesh import dp_group
from slipstream.models.gpt_pipeline import gpt_loss, gpt_pipeline_layers, load_gpt_weights_
from slipstream.pipe import PipelineModule
from tests.distributed.harness import run_world
from tests.parallel import _pipe_workloads as w

GLOBAL_MICRO_BATCHES = 4


def _engine(pp: int, stage: int) -> tuple[Any, Any]:
    module = PipelineModule(
        gpt_pipeline_layers(w.gpt_config(tie=True)), num_stages=pp, loss_fn=gpt_loss
    )
    load_gpt_weights_(module, w.reference_model(tie=True).state_dict(), w.LAYERS)
    dp = dist.get_world_size() // pp
    m = GLOBAL_MICRO_BATCHES // dp
    config = {
        "train_micro_batch_size_per_gpu": w.MICRO,
        "gradient_accumulation_steps": m,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = slipstream.initialize(model=module, config=config)
    data = w.micro_iter(m, dp, dist.get_rank(dp_group(engine.mesh)))
    return engine, data


def save_then_continue(path: str) -> list[float]:
    engine, data = _engine(pp=2, stage=3)
    for _ in range(2):
        engine.train_batch(data)
    engine.save_checkpoint(path, tag="step2")
    return [engine.train_batch(data).item() for _ in range(3)]


def load_and_continue(path: str) -> list[float]:
    engine, data = _engine(pp=4, stage=2)
    engine.load_checkpoint(path, tag="step2")
    for _ in range(2 * GLOBAL_MICRO_BATCHES):  # the two steps' micro-batches already seen
        next(data)
    return [engine.train_batch(data).item() for _ in range(3)]


def test_pp2_dp2_zero3_checkpoint_resumes_at_pp4(tmp_path: Path) -> None:
    before = run_world(save_then_continue, 4, str(tmp_path))
    after = run_world(load_and_continue, 4, str(tmp_path))
    for losses in after:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(before[0]), rtol=1e-5, atol=0)


def export_refused() -> str:
    engine, _ = _engine(pp=2, stage=1)
    try:
        engine.save_16bit_model("/nonexistent-dir-never-created")
    except ValueError as e:
        return str(e)
    return "no error"


def test_16bit_export_of_a_multi_stage_pipeline_is_refused() -> None:
    """Rank 0 holds one stage: exporting would write a partial model, so it is refused."""
    for msg in run_world(export_refused, 2):
        assert "PipelineModule with 2 stages is not supported" in msg and "save_checkpoint" in msg
