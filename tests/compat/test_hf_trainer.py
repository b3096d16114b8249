"""The Hugging Face Trainer with TrainingArguments(deepspeed=config) trains a tiny GPT-2 on
slipstream at 2 processes, ZeRO-2 and ZeRO-3 ("auto" values, the model from from_pretrained,
so ZeRO-3 goes through zero.Init), saves and resumes; with DeepSpeed installed the losses
and the saved weights equal DeepSpeed 0.19.8's."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.compat import _hf_workloads as w
from tests.distributed.harness import run_world

pytest.importorskip("transformers")
pytest.importorskip("accelerate")


class _Switch:
    """SLIPSTREAM_AS_DEEPSPEED for the ranks about to be spawned (on, or removed)."""

    def __init__(self, on: bool) -> None:
        self.on, self.old = on, os.environ.get("SLIPSTREAM_AS_DEEPSPEED")

    def __enter__(self) -> None:
        os.environ.pop("SLIPSTREAM_AS_DEEPSPEED", None)
        if self.on:
            os.environ["SLIPSTREAM_AS_DEEPSPEED"] = "1"

    def __exit__(self, *exc: object) -> None:
        os.environ.pop("SLIPSTREAM_AS_DEEPSPEED", None)
        if self.old is not None:
            os.environ["SLIPSTREAM_AS_DEEPSPEED"] = self.old


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    path = tmp_path_factory.mktemp("hf")
    w.save_tiny_gpt2(str(path / "tiny-gpt2"))
    yield str(path)


@pytest.fixture(scope="module")
def ours(workdir: str) -> dict[int, Any]:
    with _Switch(True):
        return run_world(w.trainer_runs, 2, workdir, "slipstream", timeout_s=500)[0]


def _weights(run_dir: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(Path(run_dir, "checkpoint-4"))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("stage", [2, 3])
def test_trains_saves_and_resumes(ours: dict[int, Any], stage: int) -> None:
    """Four finite, decreasing-on-average losses; the run resumed from the step-2 checkpoint
    continues with the same steps 3 and 4; the saved model loads with from_pretrained."""
    got = ours[stage]
    assert len(got["losses"]) == 4 and all(torch.isfinite(torch.tensor(got["losses"])))
    assert got["resumed"] == pytest.approx(got["losses"], rel=1e-6)
    assert set(_weights(got["dir"])) >= {"transformer.wte.weight", "lm_head.weight"}


def test_zero2_and_zero3_train_the_same(ours: dict[int, Any]) -> None:
    assert ours[3]["losses"] == pytest.approx(ours[2]["losses"], rel=1e-5)
    for key, a in _weights(ours[2]["dir"]).items():
        torch.testing.assert_close(a, _weights(ours[3]["dir"])[key], rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")
def test_equals_deepspeed(workdir: str, ours: dict[int, Any]) -> None:
    with _Switch(False):
        theirs = run_world(w.trainer_runs, 2, workdir, "deepspeed", timeout_s=500)[0]
    for stage in (2, 3):
        assert ours[stage]["losses"] == pytest.approx(theirs[stage]["losses"], rel=1e-5)
        assert ours[stage]["resumed"] == pytest.approx(theirs[stage]["resumed"], rel=1e-5)
        mine, ref = _weights(ours[stage]["dir"]), _weights(theirs[stage]["dir"])
        for key, a in ref.items():
            torch.testing.assert_close(mine[key], a, rtol=1e-5, atol=1e-6, msg=f"{stage} {key}")
