"""Sequence parallelism composed with the rest of training on a tiny HF LLaMA (4 heads,
2 KV heads): checkpoints saved at SP=2 (Ulysses, ring) resume at SP=1 on one rank and the
reverse, continuing exactly as an uninterrupted run."""

from __future__ import annotations

import pytest

from tests.distributed.harness import run_world
from tests.distributed.parity import assert_same_training
from tests.sequence import _compose_workloads as c


@pytest.fixture(scope="module")
def reshard(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("sp_ckpt"))
    one = run_world(c.reshard_one, 1, root, "save")[0]
    two = run_world(c.reshard_two, 2, root)
    back = run_world(c.reshard_one, 1, root, "resume")[0]
    return one, two, back


def test_checkpoints_reshard_across_sp_degrees(reshard):
    """fp32: the continued losses (rtol 1e-5) and final parameters (rtol 1e-5, atol 2e-5)
    equal an uninterrupted SP=1 run's, for SP=2 -> SP=1 and SP=1 -> SP=2, Ulysses (ZeRO-2)
    and ring (ZeRO-3); SGD momentum makes the optimizer state part of the check."""
    one, two, back = reshard
    for mode in c.STAGE:
        whole = one[mode]
        rest = {"losses": whole["losses"][c.SAVE_AT :], "params": whole["params"]}
        head = {"losses": whole["losses"][: c.SAVE_AT], "params": {}}
        assert_same_training(two[0][("save", mode)] | {"params": {}}, head, f"SP=2 {mode}")
        for label, got in (("SP=1 -> SP=2", two[0][("resume", mode)]), ("SP=2 -> SP=1", back[mode])):
            assert got["step"] == c.TOTAL, (label, mode, got["step"])
            assert_same_training(got, rest, f"{label} {mode}", param_rtol=1e-5, param_atol=2e-5)
        assert two[1][("resume", mode)]["losses"] == two[0][("resume", mode)]["losses"]
