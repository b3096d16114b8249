"""Engine behaviour at 2 gloo ranks: fp16 overflow, API, client optimizer, HF model, errors."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import run_world
from tests.runtime import _workloads as w

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def results():
    return run_world(w.all_checks, 2)


def test_fp16_overflow_skips_step_and_lowers_scale(results):
    """An inf on one rank skips the step on every rank, leaves weights alone, halves the scale."""
    for r in results:
        fp16 = r["fp16"]
        assert fp16["dtype"] == "torch.float16"
        assert fp16["applied"] == [(True, True), (False, False), (True, True)]
        assert fp16["scales"] == [256.0, 128.0, 128.0]
        assert fp16["skipped"] == 1 and fp16["global_steps"] == 3


def test_engine_api_with_client_optimizer_and_scheduler(results):
    """Batch triple, accumulation boundaries, counters, client optimizer kept and stepped."""
    api = results[0]["api"]
    assert api["triple"] == (8, 2, 2)
    assert api["same_optimizer_object"]
    assert api["boundaries"] == [False, True, False, True]
    assert api["lrs"] == pytest.approx([0.1, 0.05, 0.05, 0.025])
    assert api["global_steps"] == 2 and api["global_samples"] == 16
    assert api["grad_norm_positive"]
    assert "no_sync() is incompatible with ZeRO stage 2" in api["no_sync_error"]
    for twice, summed in zip(*api["double_backward"]):
        torch.testing.assert_close(twice, summed)


def test_hf_transformers_model_trains_with_auto_values(results):
    """LlamaForCausalLM from a config trains at ZeRO-2 with "auto" lr and bucket size."""
    for r in results:
        hf = r["hf"]
        assert hf["bucket"] == 64 * 64
        assert hf["losses"][-1] < hf["losses"][0] - 0.5
    for a, b in zip(results[0]["hf"]["params"], results[1]["hf"]["params"]):
        assert torch.equal(a, b)


def test_diverged_models_raise_instead_of_hanging(results):
    for r in results:
        assert "differs between ranks" in r["diverged"]
        assert "ranks [0]" in r["diverged"] and "ranks [1]" in r["diverged"]


def test_step_logging_and_comm_bytes_per_axis(results):
    """Rank 0 logs loss/lr/times/comm summary; ZeRO-2 traffic is counted on the dp axis."""
    logs = results[0]["logs"]
    text = "\n".join(logs["records"])
    assert "step=1 loss=" in text and "lr=[0.001]" in text
    assert "forward=" in text and "backward=" in text and "step=" in text
    assert "communication summary" in text
    dp = logs["summary"]["dp"]
    # One reduce-scatter of every gradient bucket (fp32) and one all-gather of the parameters.
    assert dp["reduce_scatter"]["bytes"] == logs["bucket_bytes"]
    assert dp["all_gather"]["bytes"] == logs["bucket_bytes"]
    assert dp["all_reduce"]["calls"] == 1  # the global gradient norm


def test_bf16_master_switch_manual_backward_no_sync_unmanaged(results):
    """bf16 masters live in the parameters when switched; scale()+backward equals backward();
    no_sync skips the reduction; managed_gradient_accumulation=false steps every time."""
    sw = results[0]["switches"]
    assert sw["low_master_bytes"] == 0 and sw["low_state_dtypes"] == ["torch.bfloat16"]
    assert sw["default_master_bytes"] > 0 and sw["default_state_dtypes"] == ["torch.float32"]
    assert sw["manual_norms"][0] == pytest.approx(sw["manual_norms"][1], rel=1e-6)
    # Buckets all-reduced once (the boundary backward) plus the grad-norm all-reduce.
    assert sw["no_sync_allreduce_calls"] == 2
    for a, b in zip(sw["no_sync_params"], results[1]["switches"]["no_sync_params"]):
        assert torch.equal(a, b)
    assert sw["unmanaged"] == ([True, True], 2)


def test_layerwise_lamb_exact_at_stage0_and_refused_when_split(results):
    """Lamb sees whole parameters at stage 0 (matches single-process Lamb); at stage 2, where
    parameters straddle rank shards, it is refused; unknown optimizers need the opt-in."""
    opt = results[0]["optimizers"]
    for name, ref in opt["lamb_ref"].items():
        torch.testing.assert_close(opt["lamb_params"][name], ref, rtol=1e-5, atol=1e-6)
    assert "computes per-parameter statistics" in opt["lamb_stage2"]
    assert "Use ZeRO stage 0 with Lamb" in opt["lamb_stage2"]
    assert "zero_allow_untested_optimizer: true" in opt["custom"]
    assert opt["custom_allowed_steps"] == 1
