"""``slipstream plan``: JSON output of a predicted and a searched layout, the written config,
errors, and ``--calibrate`` writing a ``local`` profile that loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slipstream.cli.main import main
from slipstream.config import parse_config
from slipstream.planner import Layout, load_hardware, model_preset, predict

FULL = ["plan", "--model", "gpt3-175b", "--gpus", "64", "--hardware", "dgx-a100-80gb",
        "--tp", "8", "--pp", "8", "--virtual-stages", "3", "--micro-batch", "1",
        "--global-batch", "64", "--zero-stage", "0", "--recompute", "full", "--json"]  # fmt: skip


def _json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_full_layout_is_predicted_as_given(capsys: pytest.CaptureFixture[str]) -> None:
    out = _json(capsys, FULL)
    expected = predict(
        model_preset("gpt3-175b"), load_hardware("dgx-a100-80gb"),
        Layout(tp=8, pp=8, dp=1, virtual_stages=3, global_batch=64, recompute="full"),
    )  # fmt: skip
    assert out["mode"] == "predict"
    assert out["step_time_s"] == pytest.approx(expected.step_time_s)
    assert out["memory_per_rank_bytes"] == expected.memory_per_rank_bytes
    assert out["tflops_per_device"] == pytest.approx(expected.tflops_per_device)
    assert out["percent_of_peak"] == pytest.approx(expected.percent_of_peak)
    assert out["layout"]["schedule"] == "interleaved"
    assert set(out["time_breakdown"]) >= {"compute_s", "tp_comm_s", "bubble_s", "dp_exposed_s"}
    assert set(out["memory_breakdown"]) >= {"params", "grads", "optimizer", "activations"}


def test_missing_fields_are_searched_and_config_written(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    target = tmp_path / "ds.json"
    out = _json(capsys, ["plan", "--layers", "24", "--hidden", "2048", "--heads", "16",
                         "--seq", "1024", "--vocab", "50304", "--gpus", "16",
                         "--hardware", "dgx-h100", "--global-batch", "64", "--top", "3",
                         "--json", "--write-config", str(target)])  # fmt: skip
    assert out["mode"] == "search" and len(out["ranked"]) == 3
    times = [r["step_time_s"] for r in out["ranked"]]
    assert times == sorted(times) and out["step_time_s"] == times[0]
    best = out["layout"]
    cfg = parse_config(json.loads(target.read_text()), dp_world_size=best["dp"])
    assert cfg.batch == (64, best["micro_batch"], best["micro_batches"])
    assert cfg.zero_optimization.stage == best["zero_stage"]


def test_bad_input_exits_2_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--layers", "4", "--gpus", "2"]) == 2
    assert "missing --hidden --heads" in capsys.readouterr().err
    assert main(["plan", "--model", "gpt3-175b", "--gpus", "2", "--hardware", "tpu"]) == 2
    assert "unknown hardware 'tpu'" in capsys.readouterr().err
    assert main([*FULL[:4], "60", *FULL[5:]]) == 2
    assert "not a multiple of tp * pp = 64" in capsys.readouterr().err


def test_calibrate_writes_a_loadable_local_profile(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Measures GEMMs and a 2-process gloo all-reduce; the result loads as 'local'."""
    monkeypatch.setenv("SLIPSTREAM_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="run `slipstream plan --calibrate`"):
        load_hardware("local")
    out = _json(capsys, ["plan", "--calibrate", "--json"])
    local = load_hardware("local")
    assert local.to_dict() == out
    assert local.peak_tflops > 0 and local.intra_node_latency_s > 0
    assert all(rate > 0 for _, rate in local.gemm_tflops)
    assert 0 < local.attention_efficiency < 10
    small = predict(model_preset("megatron-22b", layers=2, hidden=256, heads=4, seq=128),
                    local, Layout(dp=2, global_batch=4))  # fmt: skip
    assert small.step_time_s > 0
