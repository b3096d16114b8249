"""Tensors taken from a ZeRO-3 parameter inside GatheredParameters (``p.data.cpu()``, which
is ``p.data`` itself on the CPU) keep their values after the block and after later gathers,
and save and load, as in DeepSpeed (DeepSpeed-Chat's ZeRO-3 save relies on it); a zero.Init
model initialized without an optimizer is gathered in the training dtype."""

from __future__ import annotations

from tests.distributed.harness import run_world
from tests.zero import _gathered_workloads as w


def test_tensors_taken_inside_the_block_stay_valid() -> None:
    for r in run_world(w.taken_inside_stay_valid, 2):
        assert r["n"] > 0 and r["equal"] and r["loaded"]


def test_zero_init_model_without_optimizer_takes_the_training_dtype() -> None:
    for r in run_world(w.init_model_for_inference_in_bf16, 2):
        assert r["dtypes"] == ["torch.bfloat16"]
        assert r["loss"] == r["loss"]  # finite: the forward ran in one dtype
