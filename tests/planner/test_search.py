"""Search constraints (specs/parallelism.md sec. 4.5) and the config it writes."""

from __future__ import annotations

import pytest

from slipstream.config import parse_config
from slipstream.planner import Layout, load_hardware, model_preset, predict
from slipstream.planner.export import layout_to_config
from slipstream.planner.search import search, valid_tp_sizes

FRONTIER = load_hardware("frontier-mi250x")


def test_tp_stays_inside_a_node_and_divides_the_heads() -> None:
    model = model_preset("frontier-1t")  # 128 heads
    assert valid_tp_sizes(model, FRONTIER, 512) == [1, 2, 4, 8]
    assert valid_tp_sizes(model_preset("megatron-22b", heads=12), FRONTIER, 64) == [1, 2, 4]
    assert valid_tp_sizes(model, FRONTIER, 12) == [1, 2, 4]  # TP must divide the world too


@pytest.mark.parametrize("preset", ["frontier-22b", "frontier-175b", "frontier-1t"])
def test_every_ranked_layout_is_valid(preset: str) -> None:
    model = model_preset(preset)
    result = search(model, FRONTIER, 512, 1024, {"recompute": "full", "micro_batch": 1})
    assert result.ranked, "nothing fits"
    for p in result.ranked:
        layout = p.layout
        assert layout.tp * layout.pp * layout.dp == 512
        assert layout.tp <= 8 and model.heads % layout.tp == 0
        assert model.layers % (layout.pp * layout.virtual_stages) == 0
        assert p.memory_per_rank_bytes <= FRONTIER.usable_memory
        assert layout.pp == 1 or layout.zero_stage <= 1
    times = [p.step_time_s for p in result.ranked]
    assert times == sorted(times)


def test_large_models_keep_tp_inside_the_node() -> None:
    """The 1T model needs model parallelism; the fastest layouts use TP <= 8 and PP."""
    result = search(model_preset("frontier-1t"), FRONTIER, 512, 512, {"micro_batch": 1}, top=5)
    assert all(p.layout.tp <= 8 for p in result.ranked)
    assert result.rejected_memory > 0


def test_larger_global_batch_ranks_higher_per_device() -> None:
    """More micro-batches per step shrink the (p-1)/m bubble (Dash et al. sec. 4)."""
    model = model_preset("frontier-175b")
    fixed = {"tp": 8, "pp": 16, "virtual_stages": 1, "micro_batch": 1, "recompute": "full"}
    small = search(model, FRONTIER, 128, 16, fixed).ranked[0]
    large = search(model, FRONTIER, 128, 256, fixed).ranked[0]
    assert large.percent_of_peak > small.percent_of_peak


def test_fixed_fields_are_kept() -> None:
    model = model_preset("frontier-22b")
    result = search(model, FRONTIER, 32, 64, {"tp": 4, "zero_stage": 1, "recompute": "full"})
    assert {(p.layout.tp, p.layout.zero_stage, p.layout.recompute) for p in result.ranked} == {
        (4, 1, "full")
    }


def test_no_layout_explains_why() -> None:
    with pytest.raises(ValueError, match="TP must divide the heads"):
        search(model_preset("frontier-22b"), FRONTIER, 32, 20, {"tp": 16})
    with pytest.raises(ValueError, match="unknown layout fields"):
        search(model_preset("frontier-22b"), FRONTIER, 32, 32, {"tensor": 2})


def test_bad_layouts_are_refused_by_predict() -> None:
    model = model_preset("frontier-22b")
    with pytest.raises(ValueError, match=r"Layout\.tp = 5 must divide the 96 attention heads"):
        predict(model, FRONTIER, Layout(tp=5))
    with pytest.raises(ValueError, match="global_batch = 10 is not a multiple"):
        predict(model, FRONTIER, Layout(dp=4, global_batch=10))


@pytest.mark.parametrize(
    "layout",
    [
        Layout(tp=2, pp=2, dp=2, virtual_stages=2, micro_batch=2, global_batch=16,
               zero_stage=1, sequence_parallel=True, recompute="full"),
        Layout(tp=1, dp=8, zero_stage=3, hpz_partition_size=4, recompute="selective",
               global_batch=8),
        Layout(dp=4, zero_stage=2, offload_optimizer="cpu", global_batch=8, micro_batch=2),
    ],
)  # fmt: skip
def test_written_config_parses(layout: Layout) -> None:
    """The exported config is accepted by slipstream's own loader with the same batch."""
    cfg = parse_config(layout_to_config(layout), dp_world_size=layout.dp)
    assert cfg.batch == (layout.batch, layout.micro_batch, layout.micro_batches)
    assert cfg.zero_optimization.stage == layout.zero_stage
    assert cfg.tensor_parallel.autotp_size == layout.tp
    assert cfg.zero_optimization.zero_hpz_partition_size == layout.hpz_partition_size
