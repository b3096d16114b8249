"""FLOPs: the general count equals Megatron's 72/96 closed forms; %-of-peak arithmetic."""

from __future__ import annotations

import pytest

from slipstream.planner import megatron_flops, model_preset, step_flops


@pytest.mark.parametrize("preset", ["megatron-22b", "gpt3-175b", "megatron-1t"])
def test_full_recompute_flops_equal_the_96_form(preset: str) -> None:
    m = model_preset(preset)
    expected = megatron_flops(8, m.seq, m.layers, m.hidden, m.vocab, recompute=True)
    assert step_flops(m, 8, "full") == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("preset", ["megatron-22b", "gpt3-175b", "megatron-1t"])
def test_no_recompute_flops_differ_from_the_72_form_by_its_logit_term(preset: str) -> None:
    """The 72 form scales the logits by 3/4 with the layers although they are never
    recomputed: it counts 4.5 B s h V for them where forward + backward is 6 B s h V."""
    m = model_preset(preset)
    closed = megatron_flops(8, m.seq, m.layers, m.hidden, m.vocab, recompute=False)
    assert step_flops(m, 8, "none") - closed == pytest.approx(1.5 * 8 * m.seq * m.hidden * m.vocab)


def test_selective_recompute_adds_the_attention_core_forward() -> None:
    m = model_preset("megatron-22b")
    extra = step_flops(m, 2, "selective") - step_flops(m, 2, "none")
    assert extra == pytest.approx(m.layers * 4 * 2 * m.seq**2 * m.hidden)


def test_ratio_96_over_72_without_logits() -> None:
    m = model_preset("gpt3-175b")
    assert megatron_flops(1, m.seq, m.layers, m.hidden, 0, recompute=True) / megatron_flops(
        1, m.seq, m.layers, m.hidden, 0, recompute=False
    ) == pytest.approx(96 / 72)


@pytest.mark.parametrize(("percent", "tflops"), [(38.38, 73.5), (36.14, 69.2), (31.96, 61.2)])
def test_frontier_percent_of_peak_matches_tflops(percent: float, tflops: float) -> None:
    """Dash et al.'s % of peak against the press TFLOPS per GCD, at 191.5 TF per GCD."""
    from slipstream.planner import load_hardware

    peak = load_hardware("frontier-mi250x").peak_tflops
    assert 100 * tflops / peak == pytest.approx(percent, abs=0.02)
