"""RLHF trainers log through engine.monitor: a DPO step's loss, margin and accuracy reach the
configured CSV and TensorBoard monitors (and the JSON-lines file), and `slipstream plot`'s
reader finds them in all three."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.distributed.harness import run_world


def dpo_with_monitors(out_dir: str) -> list[dict[str, Any]]:
    import copy

    import slipstream
    from slipstream.rlhf import DPOConfig, DPOTrainer, pair_batch
    from tests.rlhf._chat_workloads import CharTokenizer, config, records, tiny_llama

    model = tiny_llama()
    cfg = config(0, 5e-3) | {
        "csv_monitor": {"enabled": True, "output_path": out_dir, "job_name": "csv"},
        "tensorboard": {"enabled": True, "output_path": out_dir, "job_name": "tb"},
    }
    engine, *_ = slipstream.initialize(model=model, config=cfg)
    trainer = DPOTrainer(
        engine, copy.deepcopy(model), DPOConfig(beta=0.5), log_path=Path(out_dir) / "dpo.jsonl"
    )
    tok = CharTokenizer()
    logged = [vars(trainer.step(pair_batch(tok, records(8, seed=step), 12))) for step in range(2)]
    engine.destroy()  # flushes the monitors
    return logged


def test_dpo_metrics_reach_the_monitors_and_plot(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("tensorboard")
    from slipstream.profiling.plots import read_scalars

    (logged,) = run_world(dpo_with_monitors, 1, str(tmp_path))
    scalars = read_scalars(tmp_path)
    for field in ("loss", "margin", "accuracy", "chosen_reward"):
        expected = [(float(m["step"]), m[field]) for m in logged]
        for name in (f"Train_dpo_{field}", f"Train/dpo/{field}", f"dpo/{field}"):
            assert [s for s, _ in scalars[name]] == [s for s, _ in expected], name
            assert [v for _, v in scalars[name]] == pytest.approx(
                [v for _, v in expected], rel=1e-6
            ), name
    assert "Train/Samples/train_loss" in scalars  # the engine's own events beside them
