"""Several engine.backward() calls before one step add up at every ZeRO stage, and the
generator's backward through the discriminator's engine leaves the discriminator's gradients
in .grad (zero_grad drops them, else its next step takes them in), as in PyTorch and
DeepSpeed's stage 0: the DCGAN pattern at world 2 equals plain PyTorch on the global batch
and DeepSpeed 0.19.8. A pipeline stage may start with an in-place layer."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.compat import _gan_workloads as w
from tests.distributed.harness import run_world


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_world(w.slipstream_runs, 2, timeout_s=240)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("zero_disc", [True, False], ids=["zero_grad", "no_zero_grad"])
def test_gan_matches_plain_pytorch(results: list[dict], stage: int, zero_disc: bool) -> None:
    ref = w.reference(zero_disc)
    for r in results:
        for got, want in zip(r[(stage, zero_disc)]["params"], ref["params"]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # The generator's gradients reaching the discriminator do matter: the two runs differ.
    other = results[0][(stage, not zero_disc)]["params"]
    assert any(
        not torch.allclose(a, b) for a, b in zip(results[0][(stage, zero_disc)]["params"], other)
    )


def test_backward_outside_the_engine_is_refused_at_step(results: list[dict]) -> None:
    msg = results[0]["stray"]
    assert "engine.step(): parameters '0.bias', '0.weight', '2.bias', '2.weight' hold" in msg
    assert "loss.backward() was called instead of engine.backward(loss)" in msg
    assert "module.zero_grad()" in msg


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")
def test_gan_matches_deepspeed(results: list[dict]) -> None:
    ds = run_world(w.deepspeed_runs, 2, timeout_s=240)
    for ours, theirs in zip(results, ds):
        for key, got in theirs.items():
            for stage in (0, 1, 2, 3):
                for a, b in zip(ours[(stage, key[1])]["params"], got["params"]):
                    torch.testing.assert_close(
                        a, b, rtol=1e-5, atol=1e-6, msg=f"stage {stage} {key}"
                    )
            for a, b in zip(ours[key]["losses"], got["losses"]):
                assert a == pytest.approx(b, rel=1e-5, abs=1e-6)


def test_pipeline_stage_may_start_in_place(results: list[dict]) -> None:
    """The received activation is copied (as DeepSpeed does), so ReLU(inplace=True) first
    on stage 1 trains like the unsplit model."""
    ref = w.inplace_pipeline_reference()
    for r in results:
        assert r["inplace_pipeline"]["parts"] == [0, 2, 4]
        assert r["inplace_pipeline"]["losses"] == pytest.approx(ref, rel=1e-5)
