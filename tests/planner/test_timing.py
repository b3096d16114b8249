"""Step-time pieces: the bubble, ring collectives, and their composition."""

from __future__ import annotations

import pytest

from slipstream.planner import Layout, load_hardware, model_preset, predict
from slipstream.planner.network import CommGroup, collective_time

A100 = load_hardware("dgx-a100-80gb")
M = model_preset("gpt3-175b")


@pytest.mark.parametrize(("pp", "v", "batch"), [(8, 1, 64), (8, 3, 64), (4, 1, 32), (4, 2, 8)])
def test_bubble_is_p_minus_1_over_v_m(pp: int, v: int, batch: int) -> None:
    """Narayanan et al. 2021: bubble time = (p-1)/v micro-batch times, fraction (p-1)/(v m)."""
    layout = Layout(tp=8, pp=pp, virtual_stages=v, global_batch=batch, recompute="full")
    t = predict(M, A100, layout).time
    assert t.bubble_fraction == pytest.approx((pp - 1) / (v * batch))
    assert t.bubble_s == pytest.approx((pp - 1) / v * t.micro_batch_s)
    assert t.bubble_s / (t.step_time_s - t.bubble_s - t.optimizer_s - t.dp_exposed_s) == (
        pytest.approx(t.bubble_fraction)
    )


def test_ring_all_reduce_inside_a_node() -> None:
    """2 (g-1)/g S / bw + 2 (g-1) latency, bw = 300 GB/s x 0.75 on DGX A100."""
    nbytes = 1e9
    expected = 2 * 7 / 8 * nbytes / (300e9 * 0.75) + 14 * 5e-6
    assert collective_time(A100, "all_reduce", nbytes, CommGroup(8)) == pytest.approx(expected)


def test_inter_node_rings_share_the_nics() -> None:
    """DP groups with stride 8 leave the node side by side: each gets 1/8 of 200 GB/s."""
    nbytes = 1e9
    expected = 15 / 16 * nbytes / (200e9 * 0.9 / 8) + 15 * 1e-5
    got = collective_time(A100, "all_gather", nbytes, CommGroup(16, stride=8))
    assert got == pytest.approx(expected)


def test_one_device_costs_nothing() -> None:
    assert collective_time(A100, "all_reduce", 1e9, CommGroup(1)) == 0.0


def test_tensor_parallel_time_follows_the_collective_count() -> None:
    """4 all-reduces of 2 s b h per layer; a full recompute repeats the forward's 2."""
    plain = predict(M, A100, Layout(tp=8, pp=8, global_batch=8)).time
    full = predict(M, A100, Layout(tp=8, pp=8, global_batch=8, recompute="full")).time
    one = collective_time(A100, "all_reduce", 2 * 2048 * 12288, CommGroup(8))
    assert plain.tp_comm_s == pytest.approx(8 * 12 * 4 * one)
    assert full.tp_comm_s == pytest.approx(8 * 12 * 6 * one)


def test_more_micro_batches_shrink_the_bubble_share() -> None:
    small = predict(M, A100, Layout(tp=8, pp=8, global_batch=8, recompute="full"))
    large = predict(M, A100, Layout(tp=8, pp=8, global_batch=64, recompute="full"))
    assert large.percent_of_peak > small.percent_of_peak


def test_zero3_overlap_only_hides_what_compute_covers() -> None:
    layout = Layout(tp=1, dp=64, zero_stage=3, global_batch=64, recompute="full")
    hidden = predict(M, A100, layout).time
    exposed = predict(M, A100, Layout(**{**layout.__dict__, "overlap_comm": False})).time
    assert exposed.dp_exposed_s == pytest.approx(exposed.dp_comm_s)
    assert hidden.dp_exposed_s <= exposed.dp_exposed_s


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_attention_efficiency_slows_only_the_attention_core(recompute: str) -> None:
    """Halving the attention core's rate adds its GEMM time once more: forward + backward
    (3x its forward) and the selective recompute's forward."""
    import dataclasses

    from slipstream.planner.timing import _gemm_time

    hw = load_hardware("dgx-a100-80gb")
    m = model_preset("megatron-22b", layers=4)
    layout = Layout(tp=8, dp=1, global_batch=4, recompute=recompute)
    slow = dataclasses.replace(hw, attention_efficiency=0.5)
    core = _gemm_time(hw, m.attention_core_flops_per_layer(layout.micro_batch) / layout.tp)
    passes = 3 + (recompute == "selective")
    extra = predict(m, slow, layout).time.compute_s - predict(m, hw, layout).time.compute_s
    assert extra == pytest.approx(layout.micro_batches * m.layers * passes * core, rel=1e-9)


def test_profiles_without_attention_efficiency_load_as_one() -> None:
    from slipstream.planner.hardware import Hardware

    data = load_hardware("dgx-h100").to_dict()
    del data["attention_efficiency"]
    assert Hardware.from_dict(data).attention_efficiency == 1.0
    with pytest.raises(ValueError, match="attention_efficiency = 0"):
        Hardware.from_dict({**data, "attention_efficiency": 0})
