"""A held-out MoE script written for DeepSpeed: DeepSpeedExamples' ``training/cifar/
cifar10_deepspeed.py`` with ``run_ds_moe.sh``'s flags (2 experts, ``ep_size`` 2, top-1,
RSample noise, MoE param groups; fp32, one epoch of a synthetic CIFAR-10) runs unchanged under
SLIPSTREAM_AS_DEEPSPEED=1 at 2 ranks, and its per-step losses on each rank equal DeepSpeed
0.19.8's on the same seed (1e-5 relative).

Reads the script from a DeepSpeedExamples checkout (``DEEPSPEED_EXAMPLES``: a work tree or a
bare git directory; nothing of it is in this repository) and skips without one.
"""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path
from typing import Any

import pytest

from tests.compat import _heldout_moe as h
from tests.distributed.harness import run_world

SOURCE = h.script_source()
pytestmark = pytest.mark.skipif(
    SOURCE is None, reason="set DEEPSPEED_EXAMPLES to a DeepSpeedExamples checkout"
)
STEPS = h.TRAIN_SAMPLES // 16


def _world(workdir: Path, alias: bool, reference: bool) -> list[list[float]]:
    old = os.environ.pop("SLIPSTREAM_AS_DEEPSPEED", None)
    if alias:
        os.environ["SLIPSTREAM_AS_DEEPSPEED"] = "1"
    try:
        return run_world(h.run, 2, SOURCE, str(workdir), reference, timeout_s=500)
    finally:
        os.environ.pop("SLIPSTREAM_AS_DEEPSPEED", None)
        if old is not None:
            os.environ["SLIPSTREAM_AS_DEEPSPEED"] = old


@pytest.fixture(scope="module")
def slipstream_losses(tmp_path_factory: pytest.TempPathFactory) -> list[list[float]]:
    return _world(tmp_path_factory.mktemp("cifar_moe"), alias=True, reference=False)


def test_runs_unchanged(slipstream_losses: list[list[float]]) -> None:
    """Every step of the epoch ran on both ranks with a finite loss; the two ranks saw
    different batches."""
    for losses in slipstream_losses:
        assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
    assert slipstream_losses[0] != slipstream_losses[1]


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")
def test_losses_equal_deepspeeds(
    slipstream_losses: list[list[float]], tmp_path_factory: pytest.TempPathFactory
) -> None:
    theirs: Any = _world(tmp_path_factory.mktemp("cifar_moe_ds"), alias=False, reference=True)
    for mine, ref in zip(slipstream_losses, theirs, strict=True):
        assert mine == pytest.approx(ref, rel=1e-5, abs=1e-6)
