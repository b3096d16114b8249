"""``slipstream tune``: the autotuning block, the candidates the planner ranks, and end to end
runs on 2 processes (a measured best config, a failing candidate, a run that hangs), with no
process left behind."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from slipstream.cli.main import main
from slipstream.cli.tune import _script_args
from slipstream.config import ConfigError, parse_config
from slipstream.config.autotuning import AutotuningConfig, ModelInfoConfig
from slipstream.planner import Layout, from_gpt_config, load_hardware
from slipstream.planner.autotune import (
    model_from_info,
    rank_candidates,
    select_for_measurement,
)

HERE = Path(__file__).parent
TRAIN = str(HERE / "_tune_train.py")
# slipstream.models.GPTConfig.preset("tiny", max_seq_len=32)
TINY = {"hidden_size": 64, "num_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 192, "vocab_size": 256, "seq_length": 32}  # fmt: skip
CPU_PROFILE = load_hardware("dgx-a100-80gb").to_dict() | {
    "name": "test-cpu", "peak_tflops": 0.02, "gemm_tflops": [[0.001, 0.01], [1.0, 0.02]],
    "memory_bytes": 2**32, "memory_bandwidth_gbps": 5.0, "devices_per_node": 2,
    "intra_node": [[2, 1.0]], "node_bandwidth_gbps": 2.0, "host_bandwidth_gbps": 1.0,
}  # fmt: skip


def _config(tmp_path: Path, **autotuning: Any) -> dict[str, Any]:
    return {
        "train_batch_size": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "autotuning": {
            "enabled": True, "start_profile_step": 1, "end_profile_step": 3,
            "results_dir": str(tmp_path / "results"), "exps_dir": str(tmp_path / "exps"),
            "model_info": TINY, **autotuning,
        },
    }  # fmt: skip


def _write(tmp_path: Path, config: dict[str, Any]) -> Path:
    (tmp_path / "hw.json").write_text(json.dumps(CPU_PROFILE))
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(config))
    return path


def _processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes that mention ``text`` (our runs' temp paths)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmdline = (Path("/proc") / pid / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if text.encode() in cmdline:
            found.append(f"{pid}: {cmdline.decode(errors='replace')[:200]}")
    return found


# ------------------------------------------------------------------------ the config block
def test_the_block_is_accepted_and_training_ignores_it(tmp_path: Path) -> None:
    config = parse_config(_config(tmp_path, metric="latency", tuner_type="random"),
                          dp_world_size=2)  # fmt: skip
    assert config.autotuning.enabled and config.autotuning.metric == "latency"
    assert config.autotuning.model_info == ModelInfoConfig(**TINY)


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ({"metric_path": "m.json"}, "metric_path is not supported: slipstream tune reads"),
        ({"tuner_early_stopping": 5}, "tuner_early_stopping is not supported"),
        ({"model_info": {"profile": True}}, "profile = true is not supported"),
        ({"start_profile_step": 4, "end_profile_step": 4}, "must be greater than"),
        ({"tuner_type": "bayesian"}, "'gridsearch', 'random' or 'model_based'"),
        ({"fastt": True}, "did you mean 'fast'"),
    ],
)
def test_refused_keys_say_why(block: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config({"train_batch_size": 8, "autotuning": block}, dp_world_size=2)


def test_model_info_gives_the_planner_model() -> None:
    from slipstream.models.gpt import GPT, GPTConfig

    llama = model_from_info(ModelInfoConfig(**TINY))
    config = GPTConfig.preset("tiny", max_seq_len=32)
    assert llama == from_gpt_config(config)  # same shape and accounting (name aside)
    assert llama.num_params() == sum(p.numel() for p in GPT(config).parameters())
    megatron = model_from_info(ModelInfoConfig(**(TINY | {"intermediate_size": None})))
    assert megatron.bias and not megatron.gated_mlp
    with pytest.raises(ValueError, match="num_params = 999 but the shape gives"):
        model_from_info(ModelInfoConfig(**TINY, num_params=999))
    with pytest.raises(ValueError, match=r"lacks \['seq_length'\]"):
        model_from_info(ModelInfoConfig(**(TINY | {"seq_length": None})))


# ------------------------------------------------------------------------- the candidates
def _rank(tmp_path: Path, config: dict[str, Any]) -> list[Any]:
    at = AutotuningConfig.model_validate(config["autotuning"])
    hw = load_hardware(str(_write(tmp_path, config).with_name("hw.json")))
    ranked, enumerated, rejected = rank_candidates(model_from_info(ModelInfoConfig(**TINY)),
                                                   hw, config, at, 2)  # fmt: skip
    assert enumerated == len(ranked) + rejected
    return ranked


def test_candidates_hold_what_the_config_fixes(tmp_path: Path) -> None:
    free = _rank(tmp_path, _config(tmp_path))
    layouts = {(c.prediction.layout.tp, c.prediction.layout.zero_stage) for c in free}
    assert layouts == {(1, 0), (1, 1), (1, 2), (1, 3), (2, 0)}
    assert all(c.prediction.layout.batch == 8 for c in free)
    times = [c.prediction.step_time_s for c in free]
    assert times == sorted(times)  # throughput at a fixed batch: shortest step first
    fixed = _rank(tmp_path, _config(tmp_path) | {"zero_optimization": {"stage": 2}})
    assert {c.prediction.layout.zero_stage for c in fixed} == {2}
    tp = _rank(tmp_path, _config(tmp_path, mp_size=2))
    assert {c.prediction.layout.tp for c in tp} == {2}
    best = fixed[0]
    assert best.config["zero_optimization"] == {"stage": 2}
    assert "autotuning" not in best.config
    parse_config(best.config, dp_world_size=best.prediction.layout.dp)


def test_open_batch_tries_micro_batch_sizes(tmp_path: Path) -> None:
    config = _config(tmp_path, num_tuning_micro_batch_sizes=3, max_train_batch_size=8)
    del config["train_batch_size"]
    batches = {c.prediction.layout.batch for c in _rank(tmp_path, config)}
    assert batches == {2, 4, 8}  # micro 1, 2, 4 on 2 ranks; 16 is above the maximum


def test_selection_order(tmp_path: Path) -> None:
    ranked = _rank(tmp_path, _config(tmp_path))
    at = AutotuningConfig()
    assert select_for_measurement(ranked, at, None) == ranked[:3]  # fast
    assert select_for_measurement(ranked, at, 5) == ranked[:5]
    slow = AutotuningConfig(fast=False, tuner_num_trials=4)
    assert select_for_measurement(ranked, slow, None) == ranked[:4]
    shuffled = select_for_measurement(ranked, AutotuningConfig(tuner_type="random"), 16)
    assert sorted(c.name for c in shuffled) == sorted(c.name for c in ranked)
    assert shuffled != ranked


def test_script_args_point_at_the_candidate(tmp_path: Path) -> None:
    ranked = _rank(tmp_path, _config(tmp_path))
    at = AutotuningConfig(arg_mappings={"train_micro_batch_size_per_gpu": "--batch"})
    cand, path = ranked[0], tmp_path / "c.json"
    mb = str(cand.config["train_micro_batch_size_per_gpu"])
    assert _script_args(["--deepspeed_config", "old.json", "--x"], path, cand, at) == [
        "--deepspeed_config", str(path), "--x", "--batch", mb]  # fmt: skip
    assert _script_args(["--deepspeed_config=old.json"], path, cand, AutotuningConfig()) == [
        f"--deepspeed_config={path}"]  # fmt: skip
    assert _script_args([], path, cand, AutotuningConfig()) == ["--deepspeed_config", str(path)]
    with pytest.raises(ValueError, match="'lr' is not a config key"):
        _script_args([], path, cand, AutotuningConfig(arg_mappings={"lr": "--lr"}))


def test_bad_input_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _config(tmp_path)
    del config["autotuning"]["model_info"]
    path = _write(tmp_path, config)
    assert main(["tune", "--config", str(path), "--nproc", "2", TRAIN]) == 2
    assert "autotuning.model_info (or model_info_path) is needed" in capsys.readouterr().err
    assert main(["tune", TRAIN, "--config", str(path), "--nproc", "2", "--lr", "1"]) == 2
    assert "unknown tune option(s) ['--lr', '1']: the script's own" in capsys.readouterr().err
    assert main(["tune", TRAIN, "--nproc", "2"]) == 2
    assert "give --config CFG.json and --nproc N" in capsys.readouterr().err
    path = _write(tmp_path, _config(tmp_path, metric_path="m.json"))
    assert main(["tune", "--config", str(path), "--nproc", "2", TRAIN]) == 2
    assert "metric_path is not supported" in capsys.readouterr().err


# ---------------------------------------------------------------------------- end to end
def _tune(tmp_path: Path, config: dict[str, Any], *extra: str) -> int:
    path = _write(tmp_path, config)
    script, *rest = extra
    argv = ["tune", script, "--config", str(path), "--nproc", "2", "--hardware",
            str(tmp_path / "hw.json"), *rest]  # fmt: skip
    return main(argv)


def test_tune_measures_the_best_candidates_and_writes_the_best_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two candidates trained for 3 steps each on 2 gloo ranks (about 20-30 s)."""
    assert _tune(tmp_path, _config(tmp_path), TRAIN, "--top", "2") == 0
    out = capsys.readouterr().out
    summary = json.loads((tmp_path / "results" / "summary.json").read_text())
    assert len(summary["candidates"]) == 2
    measured = {c["name"]: c["measured"] for c in summary["candidates"]}
    assert all(m["ok"] and m["samples_per_s"] > 0 for m in measured.values())
    assert all([s for s, _ in m["steps"]] == [2, 3] for m in measured.values())
    best = max(measured, key=lambda n: measured[n]["samples_per_s"])
    assert summary["best"] == best and best in out
    written = json.loads((tmp_path / "results" / "ds_config_optimal.json").read_text())
    ran = json.loads((tmp_path / "exps" / best / "ds_config.json").read_text())
    assert written | {"steps_per_print": 1} == ran  # the run only logged every step
    assert "autotuning" not in written
    parse_config(written, dp_world_size=2 // written.get("tensor_parallel", {}).get(
        "autotp_size", 1))  # fmt: skip
    assert not _processes_mentioning(str(tmp_path))


def test_a_failing_candidate_is_reported_and_cleaned_up(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _tune(tmp_path, _config(tmp_path), TRAIN, "--top", "1", "--", "--fail-rank", "1") == 1
    summary = json.loads((tmp_path / "results" / "summary.json").read_text())
    (only,) = summary["candidates"]
    assert not only["measured"]["ok"]
    assert "rank 1" in only["measured"]["error"]
    assert "every candidate failed" in capsys.readouterr().err
    assert not (tmp_path / "results" / "ds_config_optimal.json").exists()
    assert not _processes_mentioning(str(tmp_path))


def test_a_hanging_run_is_killed_at_the_timeout(tmp_path: Path) -> None:
    hang = tmp_path / "hang.py"
    hang.write_text("import time\ntime.sleep(600)\n")
    assert _tune(tmp_path, _config(tmp_path), str(hang), "--top", "1", "--timeout", "5") == 1
    summary = json.loads((tmp_path / "results" / "summary.json").read_text())
    assert "timed out after 5 s" in summary["candidates"][0]["measured"]["error"]
    assert not _processes_mentioning(str(tmp_path))


def test_overwrite_false_reuses_results(tmp_path: Path) -> None:
    """A stored result is read back instead of running the script (which would fail)."""
    config = _config(tmp_path, overwrite=False)
    ranked = _rank(tmp_path, config)
    stored = tmp_path / "exps" / ranked[0].name / "result.json"
    stored.parent.mkdir(parents=True)
    stored.write_text(json.dumps({"ok": True, "samples_per_s": 12.5, "step_time_s": 0.64,
                                  "steps": [[2, 12.5], [3, 12.5]]}))  # fmt: skip
    assert _tune(tmp_path, config, sys.executable, "--top", "1") == 0
    summary = json.loads((tmp_path / "results" / "summary.json").read_text())
    assert summary["candidates"][0]["measured"]["samples_per_s"] == 12.5
    assert Layout(**{k: v for k, v in summary["candidates"][0]["layout"].items()
                     if k in Layout.__dataclass_fields__}) == ranked[0].prediction.layout  # fmt: skip


def test_first_error_finds_the_report_inside_interleaved_output() -> None:
    """Ranks and launcher share one pipe: the report may follow a rank's unfinished line, and
    a rank's exception line may carry torch's ``[rankN]:`` prefix."""
    from slipstream.cli.tune import _first_error

    report = "slipstream run: rank 1 (local rank 1) failed with exit code 1; RuntimeError: x"
    assert _first_error(["step 1\n", f"[rank0]: half a line{report}\n"]) == report
    assert _first_error(["[rank1]: RuntimeError: rank 1 fails\n", "done\n"]) == (
        "RuntimeError: rank 1 fails"
    )
    secondary = "slipstream run: rank 0 (secondary: stopped after rank 1 failed)\n"
    assert _first_error([secondary, "ValueError: y\n"]) == "ValueError: y"
    assert _first_error(["nothing to see\n"]) == ""
