"""The ZeRO-3 parameter contract on 2 gloo ranks: weights set under zero.Init through
GatheredParameters(modifier_rank=0) are the trained model's starting weights; external
parameters; released parameters are safe to touch (DeepSpeed's empty tensor + ds_* attributes).
"""

from __future__ import annotations

import math

import pytest
import torch

from slipstream.zero import ZeroParamStatus
from tests.distributed.harness import run_world
from tests.zero import _init_workloads as w

AVAILABLE, NOT_AVAILABLE = ZeroParamStatus.AVAILABLE, ZeroParamStatus.NOT_AVAILABLE


@pytest.fixture(scope="module")
def results():
    return run_world(w.all_checks, 2)


@pytest.mark.parametrize("how", ["copy", "load_state_dict"])
def test_weights_set_before_initialize_are_the_starting_weights(results, how):
    """Issue 20: rank 0's values (rank 1 wrote 7s) survive the Init shards and initialize
    exactly, and training from them matches single-process AdamW from the same weights."""
    want, ref = w.targets(), w.reference(world=2)
    for r in results:
        got = r[how]
        for name, value in want.items():
            assert torch.equal(got["before"][name], value), name
            assert torch.equal(got["start"][name], value), name
            torch.testing.assert_close(
                got["final"][name], ref["params"][name], rtol=1e-5, atol=2e-5
            )
        torch.testing.assert_close(got["losses"], ref["losses"], rtol=1e-5, atol=0)


def test_init_parameters_carry_deepspeed_attributes(results):
    """Before initialize: empty tensors, the real shape in ds_shape, half of each parameter
    (padded) in ds_tensor; AVAILABLE inside GatheredParameters only."""
    for r in results:
        got = r["copy"]
        for name, value in w.targets().items():
            shape, ds_shape, ds_numel, shard = got["shapes"][name]
            assert shape == (0,) and ds_shape == tuple(value.shape), name
            assert ds_numel == value.numel() and shard == -(-value.numel() // 2), name
        assert got["status"] == {NOT_AVAILABLE} and got["status_inside"] == {AVAILABLE}


def test_register_external_parameter_gathers_the_borrowed_weight(results):
    ref = w.borrowing_reference(world=2)
    for r in results:
        for name, value in ref.items():
            torch.testing.assert_close(r["external"][name], value, rtol=1e-5, atol=1e-6)


def test_released_parameters_are_empty_tensors_safe_to_touch(results):
    """Issue 19: norm, sum, isnan, clone, print, repr and .cpu() of every released parameter,
    after initialize and after a step: no crash, 0 elements, the real shape in ds_shape."""
    for r in results:
        got = r["released"]
        for phase in ("touched", "after_step"):
            for name, t in got[phase].items():
                assert t["shape"] == (0,) and t["numel"] == 0, (phase, name)
                assert t["ds_shape"] == got["full_shapes"][name], (phase, name)
                assert t["status"] is NOT_AVAILABLE and t["grad"] is None, (phase, name)
                assert t["norm"] == t["sum"] == 0.0 and not t["isnan"], (phase, name)
                assert t["clone"] == (0,) and t["detach_cpu"] == [], (phase, name)
                assert "tensor([]" in t["repr"] and "tensor([]" in t["print"], (phase, name)
        assert got["in_forward"] == (AVAILABLE, got["full_shapes"]["lm_head.weight"])
        assert all(
            s is AVAILABLE and shape == got["full_shapes"][n]
            for n, (s, shape) in got["inside"].items()
        )
        assert got["state_dict_sizes"] == [0]  # DeepSpeed's empty placeholders
        assert got["ds_tensor_numel"] == pytest.approx(got["store_numel"], abs=8)


def test_a_parameter_partitioned_by_another_zero3_is_a_clear_error(results):
    for r in results:
        assert "'0.weight'" in r["foreign"]
        assert "partitioned by another ZeRO-3 implementation" in r["foreign"]


def test_weights_read_inside_gathered_parameters_survive_the_block(results):
    """Issue 38: .numpy() (which pins the storage), memoryview, torch.from_numpy, .tolist(),
    a held state_dict() and a cloned one, taken inside GatheredParameters: no crash at the
    block's exit, each keeps the gathered values after it, and training gathers on."""
    for r in results:
        got = r["read_inside"]
        for how, values in got["kept"].items():
            for name, want in got["want"].items():
                torch.testing.assert_close(values[name], want, rtol=0, atol=1e-6, msg=how)
        assert any(got["changed"].values())  # the next step changed the gathered weights


def test_persistent_parameters_are_available(results):
    """Issue 38: the parameters of a persistent unit (under stage3_param_persistence_threshold:
    the root's embedding, final norm and head) keep their full data and report AVAILABLE,
    as in DeepSpeed; the blocks' are released (NOT_AVAILABLE, empty) once initialize
    returns and after a step, eager or under zero.Init."""
    for r in results:
        for how, phases in r["persistent"].items():
            for phase, params in phases.items():
                for name, (status, shape, numel) in params.items():
                    if not name.startswith("layers."):
                        assert status is AVAILABLE, (how, phase, name)
                        assert math.prod(shape) == numel > 0, (how, phase, name)
                    else:
                        assert status is NOT_AVAILABLE and shape == (0,), (how, phase, name)
