"""The engine writes each MoE layer's routing statistics (tokens per expert, dropped
fraction, load imbalance) through its monitor list; read back from the CSV monitor."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import slipstream
from slipstream.moe import MoE

DIM, EXPERTS, TOKENS, GAS, STEPS = 8, 4, 16, 2, 2


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        expert = nn.Sequential(nn.Linear(DIM, 16), nn.GELU(), nn.Linear(16, DIM))
        # top-1 with half the capacity: tokens are dropped; exp_counts are the routed counts.
        self.moe = MoE(DIM, expert, num_experts=EXPERTS, k=1, capacity_factor=0.5, min_capacity=1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, l_aux, counts = self.moe(x)
        return out.pow(2).mean() + 0.01 * l_aux, counts


def _read(job: Path, name: str) -> list[tuple[int, float]]:
    with open(job / (name.replace("/", "_") + ".csv"), newline="") as f:
        header, *rows = list(csv.reader(f))
    assert header == ["step", name.rsplit("/", 1)[-1]]
    return [(int(s), float(v)) for s, v in rows]


def test_routing_statistics_reach_the_csv_monitor(tmp_path: Path) -> None:
    torch.manual_seed(0)
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": TOKENS,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "run"},
    }
    engine, _, _, _ = slipstream.initialize(model=_Net(), config=config)
    expected: list[dict[str, Any]] = []
    for _ in range(STEPS):
        routed = torch.zeros(EXPERTS)
        kept = torch.zeros(EXPERTS)
        for _ in range(GAS):
            loss, counts = engine(torch.randn(TOKENS, DIM))
            routed += counts.float()
            kept += engine.module.moe.stats.kept_per_expert.float()
            engine.backward(loss)
            engine.step()
        expected.append({"routed": routed, "kept": kept, "step": engine.global_samples})
    engine.destroy()
    job = tmp_path / "run"
    steps = [e["step"] for e in expected]
    assert steps == [GAS * TOKENS * (i + 1) for i in range(STEPS)]  # global_samples
    for e in range(EXPERTS):
        rows = _read(job, f"Train/Samples/moe/0/expert{e}_tokens")
        assert rows == [(s, float(x["routed"][e])) for s, x in zip(steps, expected)]
    dropped = _read(job, "Train/Samples/moe/0/dropped_fraction")
    imbalance = _read(job, "Train/Samples/moe/0/imbalance")
    for (s1, d), (s2, m), x, s in zip(dropped, imbalance, expected, steps, strict=True):
        assert s1 == s2 == s
        total = float(x["routed"].sum())
        assert total == GAS * TOKENS  # top-1: one choice per token
        assert d == pytest.approx(1 - float(x["kept"].sum()) / total, abs=1e-12) and d > 0
        assert m == pytest.approx(float(x["routed"].max()) / (total / EXPERTS), abs=1e-12)
