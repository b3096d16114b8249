"""The engine turns compression on at DeepSpeed's steps: its losses equal a plain PyTorch loop
that drives the scheduler by hand, and DeepSpeed's own engine (a release that still ships the
compression library: 0.19.8 removed it, so that test needs e.g. 0.19.6 on PYTHONPATH)."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

from tests.compression import _engine_workloads as w
from tests.compression import _models as m
from tests.distributed.harness import run_world

CONFIGS = {
    "weight_offset2": m.ds_config(weight_quantization=m.weight_quantization(offset=2)),
    "w8w4_a8_dynamic": m.ds_config(
        weight_quantization=m.weight_quantization(offset=2),
        activation_quantization=m.activation_quantization(offset=3),
    ),
    "a8_static_asymmetric": m.ds_config(
        activation_quantization=m.activation_quantization(1, "static", "asymmetric")
    ),
    "w2w1_a8_static": m.ds_config(
        weight_quantization=m.weight_quantization(offset=1, groups=1, bits=(2, 1)),
        activation_quantization=m.activation_quantization(0, "static"),
    ),
}


def _has_deepspeed_compression() -> bool:
    try:
        return importlib.util.find_spec("deepspeed.compression.compress") is not None
    except ImportError:
        return False


@pytest.fixture(scope="module")
def ours() -> dict[str, dict]:
    got = run_world(w.slipstream_runs, 1, list(CONFIGS.values()), timeout_s=300)[0]
    return dict(zip(CONFIGS, got, strict=True))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_engine_matches_the_hand_driven_schedule(ours: dict[str, dict], name: str) -> None:
    ref = w.reference_run(CONFIGS[name])
    assert ours[name]["losses"] == pytest.approx(ref, rel=1e-6, abs=1e-7)


def test_quantization_starts_exactly_at_the_offset(ours: dict[str, dict]) -> None:
    """Offset 2: the first two steps train the float model, the third is quantized."""
    plain = w.reference_run(m.ds_config())
    got = ours["weight_offset2"]["losses"]
    assert got[:2] == pytest.approx(plain[:2], rel=1e-6)
    assert abs(got[2] - plain[2]) > 1e-4


def test_zero3_at_world_2_trains_like_one_rank(ours: dict[str, dict]) -> None:
    """ZeRO-3 with every parameter released between uses (persistence threshold 0): the
    compression-aware layers quantize the gathered weights; two ranks on the same batch
    reproduce the one-rank losses."""
    cfg = copy.deepcopy(CONFIGS["w8w4_a8_dynamic"])
    cfg["train_batch_size"] = 8
    cfg["zero_optimization"] = {"stage": 3, "stage3_param_persistence_threshold": 0}
    got = run_world(w.slipstream_run, 2, cfg, False, timeout_s=300)
    for rank in got:
        assert rank["losses"] == pytest.approx(ours["w8w4_a8_dynamic"]["losses"], rel=1e-5)


@pytest.mark.skipif(
    not _has_deepspeed_compression(),
    reason="needs DeepSpeed's compression library (removed in 0.19.8; 0.19.6 has it)",
)
def test_engine_matches_deepspeed(ours: dict[str, dict]) -> None:
    """Same losses, eval logits and cleaned weights as DeepSpeed's engine (fp32 CPU)."""
    theirs = run_world(w.deepspeed_runs, 1, list(CONFIGS.values()), timeout_s=300)[0]
    for name, got in zip(CONFIGS, theirs, strict=True):
        assert ours[name]["losses"] == pytest.approx(got["losses"], rel=1e-6, abs=1e-7), name
        torch.testing.assert_close(ours[name]["eval"], got["eval"], rtol=1e-6, atol=1e-6)
        for key, value in got["state"].items():
            torch.testing.assert_close(ours[name]["state"][key], value, rtol=1e-6, atol=1e-6)


def test_moq_quantizes_the_fp16_weights_after_each_step() -> None:
    """MoQ through the engine: after training, a 4-bit group's fp16 weights hold at most 16
    levels per quantization group."""
    from tests.compression import _parity_workloads as pw

    cfg = pw.moq_config("symmetric", (6, 4), False)
    got = run_world(w.slipstream_run, 1, cfg, timeout_s=300)[0]
    inter = got["state"]["bert.encoder.layer.0.intermediate.dense.weight"]
    assert inter.dtype == torch.float16
    assert max(g.unique().numel() for g in inter.float().reshape(8, -1)) <= 16
    assert got["state"]["classifier.weight"].float().unique().numel() > 16  # in no group


def test_moq_needs_fp16() -> None:
    """As DeepSpeed asserts: MoQ overwrites fp16 weights, so it is refused without fp16."""
    from types import SimpleNamespace

    from slipstream.compression.engine import _moq
    from slipstream.config import ConfigError, parse_config
    from tests.compression import _parity_workloads as pw

    cfg = pw.moq_config("symmetric", (6, 4), False)
    del cfg["fp16"]
    engine = SimpleNamespace(config=parse_config(cfg), module=m.tiny_bert(0))
    with pytest.raises(ConfigError, match="quantize_weight_in_forward' = false \\(MoQ\\)"):
        _moq(engine)
