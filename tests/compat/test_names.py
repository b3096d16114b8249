"""Names DeepSpeedExamples import: ``deepspeed.runtime.utils.move_to_device`` (as
DeepSpeed's, checked against it when installed) and ``deepspeed.comm.TorchBackend`` (its
collectives are the comm layer's, counted)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from slipstream.runtime.utils import move_to_device
from tests.compat import _names_workloads as w
from tests.distributed.harness import run_world


def _nested() -> dict:
    return {"a": [torch.ones(2), (torch.zeros(1, dtype=torch.int64), "tag")], "b": torch.ones(3)}


def test_move_to_device_rebuilds_containers_and_moves_in_place_on_criterion() -> None:
    """(A dtype stands in for a second device on a CPU-only machine: ``.to`` takes both.)"""
    item = _nested()
    moved = move_to_device(item, torch.float64)
    assert moved["a"][0].dtype == torch.float64 and moved["a"][1][1] == "tag"
    assert isinstance(moved["a"][1], tuple) and item["b"].dtype == torch.float32  # a copy
    keep = item["b"]
    again = move_to_device(item, torch.float64, criterion_func=lambda t: t is keep)
    assert again["b"] is keep and keep.dtype == torch.float64  # in place: the same object
    assert again["a"][0].dtype == torch.float64 and item["a"][0].dtype == torch.float32


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")
def test_move_to_device_matches_deepspeeds() -> None:
    from tests.compat._deepspeed import import_deepspeed

    import_deepspeed()
    from deepspeed.runtime.utils import move_to_device as theirs  # the real one

    if getattr(importlib.import_module("deepspeed"), "__slipstream_version__", None):
        pytest.skip("deepspeed is slipstream here (SLIPSTREAM_AS_DEEPSPEED=1)")
    tensors = {"x": [torch.arange(3.0), (torch.ones(2, 2),)]}
    ours, ref = move_to_device(tensors, torch.float64), theirs(tensors, torch.float64)
    assert ours["x"][0].dtype == ref["x"][0].dtype == torch.float64
    assert type(ours["x"][1]) is type(ref["x"][1]) and torch.equal(ours["x"][1][0], ref["x"][1][0])


def test_torch_backend_collectives_go_through_the_comm_layer() -> None:
    r0, r1 = run_world(w.torch_backend_collectives, 2)
    assert r0["gathered"] == r1["gathered"] == [1.0, 1.0, 2.0, 2.0]
    # sum over ranks of arange(4) + rank = [1, 3, 5, 7]; rank r keeps slice r
    assert r0["scattered"] == [1.0, 3.0] and r1["scattered"] == [5.0, 7.0]
    assert r0["counted"][0] > 0


def test_point_to_point_and_allgather_fn() -> None:
    r0, r1 = run_world(w.point_to_point, 2)
    assert r1["got"] == [5.0] * 3 + [10.0] * 3
    assert r0["gathered"] == r1["gathered"] == [0.0, 0.0, 1.0, 1.0]


def test_point_to_point_refusals() -> None:
    from slipstream import comm

    with pytest.raises(ValueError, match="tag=3"):
        comm.send(torch.zeros(1), 1, tag=3)
    with pytest.raises(ValueError, match="src=None"):
        comm.recv(torch.zeros(1))


def test_constants_are_the_launchers() -> None:
    """``deepspeed.constants`` (DeepSpeedExamples' deepnvme checkpoint script): DeepSpeed's
    names and port; the timeout is the one the comm layer uses."""
    from slipstream import constants
    from slipstream.cli.launcher import DEFAULT_MASTER_PORT
    from slipstream.distributed.timeouts import comm_timeout

    assert constants.TORCH_DISTRIBUTED_DEFAULT_PORT == DEFAULT_MASTER_PORT == 29500
    assert (constants.CROSS_RANK, constants.CROSS_SIZE) == ("CROSS_RANK", "CROSS_SIZE")
    assert constants.default_pg_timeout == comm_timeout()
