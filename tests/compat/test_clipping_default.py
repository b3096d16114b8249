"""A config without ``gradient_clipping`` clips at 1.0, as DeepSpeed 0.19.8 does; 0.0 turns
clipping off; the applied default is logged once."""

from __future__ import annotations

import importlib.util
import logging

import pytest
import torch

from slipstream.config import loader, parse_config
from slipstream.version import DEEPSPEED_VERSION
from tests.compat import _clip_workloads as w
from tests.distributed.harness import run_world


def test_absent_key_means_one_and_is_logged_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """parse_config({}) gives 1.0, explicit values stay, one log line names the default."""
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("slipstream")
    log.addHandler(handler)
    monkeypatch.setattr(loader, "_clipping_default_noted", False)
    try:
        base = {"train_micro_batch_size_per_gpu": 1}
        assert parse_config(base).gradient_clipping == 1.0
        assert parse_config(base).gradient_clipping == 1.0
        assert parse_config({**base, "gradient_clipping": 0.0}).gradient_clipping == 0.0
        assert parse_config({**base, "gradient_clipping": 0.5}).gradient_clipping == 0.5
    finally:
        log.removeHandler(handler)
    noted = [m for m in records if "no 'gradient_clipping'" in m]
    assert len(noted) == 1, records
    assert f"DeepSpeed {DEEPSPEED_VERSION}" in noted[0] and "0.0" in noted[0]


@pytest.fixture(scope="module")
def slipstream_results() -> list[dict]:
    return run_world(w.slipstream_runs, 2, timeout_s=180)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_absent_key_clips_the_step_at_one(slipstream_results: list[dict], stage: int) -> None:
    """SGD(lr=1) moves the weights by exactly the clipped gradient: norm 1 without the key,
    the raw norm (far above 1) with 0.0."""
    for r in slipstream_results:
        clipped, raw = r[(stage, None)], r[(stage, 0.0)]
        assert raw["grad_norm"] > 10
        assert clipped["update_norm"] == pytest.approx(1.0, rel=1e-4)
        assert raw["update_norm"] == pytest.approx(raw["grad_norm"], rel=1e-4)


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")
def test_same_step_as_deepspeed(slipstream_results: list[dict]) -> None:
    """With and without the key, slipstream's weights after the step equal DeepSpeed's."""
    ds = run_world(w.deepspeed_runs, 2, timeout_s=180)
    for ours, theirs in zip(slipstream_results, ds):
        for key, got in theirs.items():
            for a, b in zip(ours[key]["after"], got["after"]):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"{key}")
