"""bf16 gradient reduction at ZeRO-2/3, 2 ranks: by default the averaged gradient keeps fp32
precision (the ranks' bf16 gradients summed in fp32); ``"communication_data_type": "bf16"``
sums them in bf16, which is what DeepSpeed 0.19.8 does with bf16 (its gradients stay in the
parameters' dtype): the switch docs/compatibility.md gives for DeepSpeed's numbers, where
DeepSpeed-Chat's steps then match DeepSpeed bit for bit. Checked on DeepSpeed 0.19.8 with
this workload (its ``safe_get_full_grad`` after ``backward``, stages 2 and 3): the bf16-rounded
mean, also with ``"communication_data_type": "fp32"``.

Exact comparisons hold on any CPU: a sum of two bf16 values is exact in fp32, halving is
exact, and one rounding of the exact sum to bf16 is what a bf16 sum gives.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.distributed.harness import run_world
from tests.zero import _comm_dtype_workloads as w


@pytest.fixture(scope="module")
def ranks() -> list[dict[Any, dict[str, Any]]]:
    return run_world(w.all_cases, 2, None, timeout_s=300)


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_gradients_reduced_in_fp32_by_default_or_bf16_as_deepspeed(
    ranks: list[dict[Any, dict[str, Any]]], stage: int
) -> None:
    own0, own1 = ranks[0][(stage, None)]["own"], ranks[1][(stage, None)]["own"]
    fp32_mean = [(a.float() + b.float()) / 2 for a, b in zip(own0, own1, strict=True)]
    bf16_mean = [(a.float() + b.float()).bfloat16().float() / 2 for a, b in zip(own0, own1)]
    assert any(not torch.equal(a, b) for a, b in zip(fp32_mean, bf16_mean)), "degenerate data"
    for rank in ranks:
        default, deepspeed = rank[(stage, None)]["full"], rank[(stage, "bf16")]["full"]
        assert len(default) == len(deepspeed) == len(fp32_mean) == 4
        for got, want in zip(default, fp32_mean, strict=True):
            assert got.dtype == torch.float32
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        for got, want in zip(deepspeed, bf16_mean, strict=True):
            torch.testing.assert_close(got.float(), want, rtol=0, atol=0)
