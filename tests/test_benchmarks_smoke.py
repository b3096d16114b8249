"""Smoke test of the benchmark harness: a DDP world of 2 gloo ranks on the tiny GPT."""

from __future__ import annotations

import math
from functools import partial

from benchmarks._harness import BenchConfig, run_framework, run_interleaved
from benchmarks._peers import PEERS
from benchmarks.train_step import build_gpt, format_table


def test_ddp_world_of_two_reports_sane_timing_memory_and_optimizer_state() -> None:
    """Harness runs DDP at world 2 and returns positive times, memory and Adam state."""
    cfg = BenchConfig(world=2, batch=2, seq=32, steps=2, warmup=1, timeout_s=120)
    result = run_framework("ddp", PEERS["ddp"], cfg, partial(build_gpt, "tiny", cfg.seq))

    assert result.ok, f"{result.error}\n{result.detail}"
    assert [r.rank for r in sorted(result.ranks, key=lambda r: r.rank)] == [0, 1]
    params = build_gpt("tiny", cfg.seq).num_params()
    for rank in result.ranks:
        assert len(rank.step_ms) == cfg.steps and all(t > 0 for t in rank.step_ms)
        assert rank.p10_ms <= rank.median_ms <= rank.p90_ms
        assert rank.tokens_per_s > 0
        assert rank.peak_mem_bytes > 0
        # DDP keeps full AdamW state on every rank: exp_avg + exp_avg_sq in fp32 (+ step).
        assert 8 * params <= rank.optim_state_bytes <= 8 * params + 4096
        assert len(rank.losses) == cfg.warmup + cfg.steps
        assert all(math.isfinite(loss) for loss in rank.losses)
    assert "ddp" in format_table([result])


def test_interleaved_row_switches_the_monitors_off_and_on() -> None:
    """The monitors row runs off/on blocks in one world (alternating order) and reports one
    on/off ratio per repeat, wall and CPU; the losses keep going down one trajectory."""
    cfg = BenchConfig(world=1, batch=2, seq=16, steps=2, warmup=1, timeout_s=120)
    peer = PEERS["slipstream-z2-monitors"]
    result = run_interleaved("m", peer, cfg, partial(build_gpt, "tiny", cfg.seq), repeats=2)

    assert result.ok, f"{result.error}\n{result.detail}"
    (rank,) = result.ranks
    assert [on for on, _, _ in rank.blocks] == [False, True, True, False]
    assert all(wall > 0 and cpu > 0 for _, wall, cpu in rank.blocks)
    assert len(rank.step_ms) == 2 * cfg.steps  # the "on" steps
    assert len(rank.losses) == 2 * cfg.warmup + 4 * cfg.steps
    for ratios in (result.on_off_ratios, result.on_off_cpu_ratios):
        assert len(ratios) == 2 and all(math.isfinite(r) and r > 0 for r in ratios)
    assert "on/off over 2 interleaved repeats" in format_table([result])
