"""``deepspeed.utils`` names: safe_get/set_full_* give real whole values at every ZeRO stage
(world 2, against a one-process reference) and zero_to_fp32 reads slipstream checkpoints."""

from __future__ import annotations

import pytest
import torch

from tests.compat import _utils_workloads as w
from tests.distributed.harness import run_world

CASES = [(0, False), (1, False), (2, True), (3, False)]


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_world(w.utils_runs, 2, timeout_s=300)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"stage{c[0]}{'-bf16' if c[1] else ''}")
def test_safe_get_full_values(results: list[dict], case: tuple[int, bool]) -> None:
    """Full grad = the reference DP-average gradient; after one AdamW step exp_avg is
    (1 - beta1) x grad and the fp32 master is the module's weight (bf16: its rounding)."""
    tol = {"rtol": 2e-2, "atol": 2e-3} if case[1] else {"rtol": 1e-5, "atol": 1e-6}
    for r in results:
        got = r[case]
        assert got["before_step_state"] is None  # no optimizer state before the first step
        for name, ref in got["ref_grads"].items():
            torch.testing.assert_close(got["grads"][name], ref, **tol, msg=name)
            torch.testing.assert_close(
                got["exp_avg"][name].float(), (1 - w.BETAS[0]) * got["grads"][name], **tol
            )
            fp32 = got["fp32"][name]
            assert fp32.dtype == torch.float32 and fp32.shape == ref.shape
            module_tol = {"rtol": 1e-2, "atol": 1e-2} if case[1] else {"rtol": 0, "atol": 0}
            torch.testing.assert_close(fp32, got["module"][name], **module_tol)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"stage{c[0]}{'-bf16' if c[1] else ''}")
def test_safe_set_full_values(results: list[dict], case: tuple[int, bool]) -> None:
    """Setters write every rank's piece: the getters and the module's weight see the value."""
    for r in results:
        got = r[case]
        assert torch.equal(got["set_fp32"], got["new"])
        assert torch.equal(got["set_state"], got["new"] * 2)
        torch.testing.assert_close(got["set_module"], got["new"], rtol=1e-2, atol=1e-2)
        assert got["frozen_is_none"] is None


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"stage{c[0]}{'-bf16' if c[1] else ''}")
def test_zero_to_fp32_reads_the_masters(results: list[dict], case: tuple[int, bool]) -> None:
    """get_fp32_state_dict_from_zero_checkpoint and the pytorch_model.bin it writes hold the
    fp32 masters exactly."""
    got = results[0][case]
    assert set(got["from_ckpt"]) == set(got["fp32"])
    for name, master in got["fp32"].items():
        assert torch.equal(got["from_ckpt"][name], master), name
        assert torch.equal(got["bin"][name], master), name
