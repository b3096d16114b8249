"""Layer reduction and the four pruning kinds against DeepSpeed's compression library: the
student DeepSpeed initialises, the forward at each schedule point and the model
redundancy_clean leaves (pruned rows, heads and channels removed with their related inputs).

DeepSpeed 0.19.8 removed the library; these run where DeepSpeed still ships it (0.19.6, e.g.
``pip install --no-deps --target DIR deepspeed==0.19.6`` and ``PYTHONPATH=DIR``). Learned
scores (``method: topk``) are overwritten from one seeded generator on both sides, since each
library draws its initial scores at its own point of the RNG stream. Two DeepSpeed paths
cannot run and are checked against hand-computed masks in test_pruning.py instead: l1/topk
sparse pruning under its scheduler (KeyError 'schedule_offset_end'; here the switch is set
by hand on both sides) and l1 channel pruning (torch.linalg.norm over three dims raises).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.compression import _models as m
from tests.compression import _parity_workloads as w
from tests.distributed.harness import run_world


def _has_deepspeed_compression() -> bool:
    try:
        return importlib.util.find_spec("deepspeed.compression.compress") is not None
    except ImportError:
        return False


pytestmark = pytest.mark.skipif(
    not _has_deepspeed_compression(),
    reason="needs DeepSpeed's compression library (removed in 0.19.8; 0.19.6 has it)",
)

CASES = {
    "sparse_l1": (m.ds_config(**m.pruning("sparse_pruning", "l1")), False, 3),
    "sparse_topk": (m.ds_config(**m.pruning("sparse_pruning", "topk")), False, 3),
    "row_l1": (m.ds_config(**m.pruning("row_pruning", "l1")), False, 3),
    "row_topk": (m.ds_config(**m.pruning("row_pruning", "topk")), False, 3),
    "head_topk": (m.ds_config(**m.pruning("head_pruning", "topk", 2, num_heads=m.HEADS)), False, 4),
    "channel_topk": (m.ds_config(**m.pruning("channel_pruning", "topk", 0)), True, 2),
    "sparse_conv_l1": (m.ds_config(**m.pruning("sparse_pruning", "l1")), True, 3),
}


@pytest.fixture(scope="module")
def runs() -> tuple[dict, dict]:
    cases = list(CASES.values())
    ours = run_world(w.all_runs, 1, "slipstream", cases, timeout_s=300)[0]
    theirs = run_world(w.all_runs, 1, "deepspeed", cases, timeout_s=300)[0]
    return ours, theirs


def test_student_initialisation_matches(runs: tuple[dict, dict]) -> None:
    ours, theirs = runs
    assert ours["student"].keys() == theirs["student"].keys()
    for key, value in theirs["student"].items():
        torch.testing.assert_close(ours["student"][key], value, rtol=0, atol=0, msg=key)


@pytest.mark.parametrize("name", list(CASES))
def test_pruning_matches(runs: tuple[dict, dict], name: str) -> None:
    """Forward before the offset, after it, and after redundancy_clean; the cleaned state
    (shapes included) equals DeepSpeed's (fp32 CPU, tolerance 1e-6)."""
    i = list(CASES).index(name)
    got, want = runs[0]["pruning"][i], runs[1]["pruning"][i]
    for step, (a, b) in enumerate(zip(got["outs"], want["outs"], strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=f"forward {step}")
    assert not torch.allclose(got["outs"][0], got["outs"][-2]) or name == "channel_topk"
    assert got["state"].keys() == want["state"].keys()
    for key, value in want["state"].items():
        assert got["state"][key].shape == value.shape, key
        torch.testing.assert_close(got["state"][key], value, rtol=1e-6, atol=1e-6, msg=key)


def test_moq_quantizer_matches() -> None:
    """MoQ (quantize_weight_in_forward false): the fp16 weights after each quantize call
    (bits stepping down every period, which doubles; fp16 blend; ternary and binary) equal
    DeepSpeed's Quantizer's, exactly. The engine's fp16 steps themselves differ from
    DeepSpeed 0.19.6's on CPU without compression, so the step is compared alone."""
    ours = run_world(w.moq_steps, 1, "slipstream", timeout_s=300)[0]
    theirs = run_world(w.moq_steps, 1, "deepspeed", timeout_s=300)[0]
    for case, got, want in zip(w.MOQ_CASES, ours, theirs, strict=True):
        for step, (a, b) in enumerate(zip(got, want, strict=True)):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"{case} step {step}")
