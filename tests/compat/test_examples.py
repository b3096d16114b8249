"""Scripts written in the style of DeepSpeedExamples (CIFAR-10 with --deepspeed_config,
HelloDeepSpeed's BERT MLM with offload and checkpoint resume, the pipeline AlexNet, the
DCGAN with two engines, the getting-started tutorial, DeepSpeed-Chat step 1 SFT on a tiny
OPT loaded with from_pretrained) run at world 2 on CPU with only their imports changed, in an
environment where ``deepspeed`` cannot be imported, and unchanged under
SLIPSTREAM_AS_DEEPSPEED=1; with DeepSpeed installed their fp32 losses equal DeepSpeed
0.19.8's within 1e-5."""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from slipstream.parallel.pipeline import partition_balanced
from tests.compat import _script_runner as runner
from tests.distributed.harness import run_world

pytest.importorskip("transformers")

SCRIPTS = list(runner.jobs("/", "switch"))


def _flat(losses: Any) -> list[float]:
    if isinstance(losses, dict):
        return [x for key in sorted(losses) for x in _flat(losses[key])]
    if isinstance(losses, list):
        return [x for item in losses for x in _flat(item)]
    return [float(losses)]


def _close(a: Any, b: Any, rel: float) -> None:
    xs, ys = _flat(a), _flat(b)
    assert len(xs) == len(ys) > 0
    for x, y in zip(xs, ys):
        assert math.isfinite(x) and x == pytest.approx(y, rel=rel, abs=rel), (xs, ys)


class _Env:
    """Set or remove SLIPSTREAM_AS_DEEPSPEED for the ranks about to be spawned."""

    def __init__(self, value: str | None) -> None:
        self.value, self.old = value, os.environ.get("SLIPSTREAM_AS_DEEPSPEED")

    def __enter__(self) -> None:
        os.environ.pop("SLIPSTREAM_AS_DEEPSPEED", None)
        if self.value is not None:
            os.environ["SLIPSTREAM_AS_DEEPSPEED"] = self.value

    def __exit__(self, *exc: object) -> None:
        os.environ.pop("SLIPSTREAM_AS_DEEPSPEED", None)
        if self.old is not None:
            os.environ["SLIPSTREAM_AS_DEEPSPEED"] = self.old


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    path = tmp_path_factory.mktemp("examples")
    runner.prepare(str(path))
    yield str(path)


@pytest.fixture(scope="module")
def slipstream_results(workdir: str) -> dict[str, Any]:
    with _Env("1"):
        return run_world(runner.slipstream_modes, 2, workdir, timeout_s=500)[0]


@pytest.mark.parametrize("mode", ["import", "switch"])
@pytest.mark.parametrize("script", SCRIPTS)
def test_runs_on_slipstream(slipstream_results: dict[str, Any], script: str, mode: str) -> None:
    """ "import": only the imports changed, with `deepspeed` unimportable (an environment
    without DeepSpeed); "switch": the file unchanged, under SLIPSTREAM_AS_DEEPSPEED=1."""
    got = slipstream_results[mode][script]
    assert not isinstance(got, str), got
    assert all(math.isfinite(x) for x in _flat(got))


@pytest.mark.parametrize("script", SCRIPTS)
def test_both_ways_train_the_same(slipstream_results: dict[str, Any], script: str) -> None:
    """The two ways give the same losses (the SFT runs ZeRO-2 one way, ZeRO-3 through
    HfDeepSpeedConfig and zero.Init the other: fp32 noise apart, the same)."""
    _close(slipstream_results["import"][script], slipstream_results["switch"][script], 1e-5)


def test_bert_resumes_where_it_stopped(slipstream_results: dict[str, Any]) -> None:
    """Steps 5-6 after load_checkpoint equal steps 5-6 of a run that never stopped."""
    for mode in ("import", "switch"):
        got = slipstream_results[mode]["bert_mlm.py"]
        _close(got["first"] + got["resumed"], got["straight"], 1e-6)


def test_alexnet_cut_where_deepspeed_cuts() -> None:
    """partition_method="parameters" cuts the script's AlexNet (trainable parameters per
    layer below) before the second classifier Linear, as DeepSpeed does: the zero-parameter
    ReLU and Dropout after the first Linear tie, and the later cut wins."""
    counts = [224, 0, 0, 1168, 0, 0, 0, 0, 0, 32896, 0, 0, 4128, 0, 330]
    assert partition_balanced(counts, 2) == [0, 12, 15]


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")
def test_losses_equal_deepspeeds(workdir: str, slipstream_results: dict[str, Any]) -> None:
    with _Env(None):
        theirs = run_world(runner.deepspeed_mode, 2, workdir, timeout_s=500)[0]["deepspeed"]
    for script in SCRIPTS:
        assert not isinstance(theirs[script], str), theirs[script]
        for mode in ("import", "switch"):
            _close(slipstream_results[mode][script], theirs[script], 1e-5)
    report = {s: _max_rel(slipstream_results["switch"][s], theirs[s]) for s in SCRIPTS}
    Path(workdir, "max_rel_diff.txt").write_text(repr(report))
    print("max relative loss difference vs DeepSpeed:", report)


def _max_rel(a: Any, b: Any) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(_flat(a), _flat(b)))
