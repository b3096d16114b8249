"""DeepSpeed's module names on slipstream: accelerator, ops.adam, runtime.utils,
runtime.lr_schedules, utils (log_dist, OnDevice), comm.init_distributed; each acts as
DeepSpeed's or refuses with the reason."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import random
import subprocess
import sys

import pytest
import torch
from torch import nn

import slipstream
from slipstream.accelerator import TorchAccelerator, get_accelerator
from slipstream.ops.adam import DeepSpeedCPUAdam, FusedAdam
from slipstream.optim.kinds import optimizer_kind
from slipstream.runtime import lr_schedules
from slipstream.runtime.utils import see_memory_usage, set_random_seed
from slipstream.utils import OnDevice, log_dist
from tests.distributed.harness import run_code

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
_ACCEL_PROBE = """
import json, sys
sys.path.insert(0, {root!r})
if {ours}:
    from slipstream.accelerator import get_accelerator
else:
    from tests.compat._deepspeed import import_deepspeed
    import_deepspeed()
    from deepspeed.accelerator import get_accelerator
a = get_accelerator()
print(json.dumps([a.device_name(), a.device_name(1), a.current_device_name(), int(a.current_device()),
                  a.device_count(), a.is_available(), a.is_bf16_supported(),
                  bool(a.is_fp16_supported()), a.communication_backend_name(),
                  a.memory_allocated() > 0, a.max_memory_allocated() >= a.memory_allocated()]))
"""


def _probe(ours: bool) -> list:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "LOCAL_RANK": "1", "DS_ACCELERATOR": "cpu"}
    env.pop("SLIPSTREAM_AS_DEEPSPEED", None)
    code = _ACCEL_PROBE.format(root=root, ours=ours)
    proc = run_code(code, env=env, timeout_s=120)  # forked warm
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_cpu_accelerator_answers() -> None:
    """device names, LOCAL_RANK as current device, gloo, bf16, RSS-based memory counters."""
    got = _probe(ours=True)
    assert got[:4] == ["cpu", "cpu", "cpu", 1]
    assert got[4] >= 1 and got[5] and got[6] and got[8] == "gloo" and got[9] and got[10]


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="needs deepspeed")
def test_cpu_accelerator_matches_deepspeed() -> None:
    assert _probe(ours=True) == _probe(ours=False)


def test_accelerator_selection_and_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    from slipstream.accelerator import real_accelerator

    monkeypatch.setattr(real_accelerator, "_current", None)
    monkeypatch.setenv("DS_ACCELERATOR", "xpu")
    with pytest.raises(ValueError, match="DS_ACCELERATOR='xpu': slipstream runs on cuda or cpu"):
        get_accelerator()
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    acc = get_accelerator()
    assert acc is get_accelerator() and acc.device_name() == "cpu"
    acc.manual_seed(3)
    a = torch.rand(2)
    torch.manual_seed(3)
    assert torch.equal(a, torch.rand(2))
    t = torch.ones(2)
    assert acc.pin_memory(t) is t and acc.synchronize() is None and acc.empty_cache() is None
    with pytest.raises(ValueError, match="expected 'cpu' or 'cuda'"):
        TorchAccelerator("npu")


@pytest.mark.parametrize(
    "cls, mode_kw", [(FusedAdam, "adam_w_mode"), (DeepSpeedCPUAdam, "adamw_mode")]
)
@pytest.mark.parametrize("decoupled", [True, False])
def test_adam_classes_match_torch(cls: type, mode_kw: str, decoupled: bool) -> None:
    """AdamW mode equals torch.optim.AdamW, Adam mode equals Adam with L2 decay; ZeRO sees an
    elementwise optimizer."""
    torch.manual_seed(0)
    ours, ref = nn.Linear(4, 3), nn.Linear(4, 3)
    ref.load_state_dict(ours.state_dict())
    hp = {"lr": 0.05, "betas": (0.8, 0.9), "eps": 1e-6, "weight_decay": 0.1}
    opt = cls(ours.parameters(), **hp, **{mode_kw: decoupled})
    ref_opt = (torch.optim.AdamW if decoupled else torch.optim.Adam)(ref.parameters(), **hp)
    for step in range(3):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
        for m, o in ((ours, opt), (ref, ref_opt)):
            o.zero_grad()
            m(x).square().sum().backward()
            o.step()
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert optimizer_kind(cls) == "elementwise"


def test_adam_refusals() -> None:
    p = [nn.Parameter(torch.ones(2))]
    with pytest.raises(RuntimeError, match="does not implement AMSGrad"):
        FusedAdam(p, amsgrad=True)
    with pytest.raises(ValueError, match="bias_correction=False"):
        DeepSpeedCPUAdam(p, bias_correction=False)


def test_runtime_utils_and_lr_schedules(caplog: pytest.LogCaptureFixture) -> None:
    set_random_seed(2**70 + 5)  # wider than numpy and torch accept: reduced, as DeepSpeed
    a = (random.random(), torch.rand(1))
    set_random_seed(2**70 + 5)
    assert (random.random(), torch.rand(1)) == a
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())  # type: ignore[method-assign]
    logging.getLogger("slipstream").addHandler(handler)
    try:
        see_memory_usage("quiet")
        see_memory_usage("after load", force=True)
        log_dist("hello", ranks=[0])
    finally:
        logging.getLogger("slipstream").removeHandler(handler)
    assert len(records) == 2 and records[0].startswith("after load | MA ")
    assert records[1] == "[Rank -1] hello"  # before init_distributed every process logs
    assert lr_schedules.WarmupLR is slipstream.optim.schedules.WarmupLR
    assert "WarmupCosineLR" in lr_schedules.VALID_LR_SCHEDULES


def test_on_device_builds_on_meta_in_the_dtype() -> None:
    with OnDevice(dtype=torch.bfloat16, device="meta"):
        model = nn.Linear(4, 4)
        explicit = torch.zeros(2, device="cpu")
        ints = torch.ones(2, dtype=torch.int64)
    assert model.weight.device.type == "meta" and model.weight.dtype == torch.bfloat16
    assert explicit.device.type == "cpu" and explicit.dtype == torch.bfloat16
    assert ints.dtype == torch.int64 and ints.device.type == "meta"
    with OnDevice(dtype=torch.float16, enabled=False):
        assert nn.Linear(2, 2).weight.dtype == torch.float32


def test_init_distributed_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    from slipstream import comm

    if comm.is_initialized():
        pytest.skip("a process group from an earlier test")
    with pytest.raises(RuntimeError, match="dist_init_required=False"):
        slipstream.init_distributed(dist_init_required=False)
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="started by MPI"):
        slipstream.init_distributed()


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="needs deepspeed")
def test_real_deepspeed_objects_are_refused_by_initialize() -> None:
    """`import slipstream as deepspeed` + a real `from deepspeed.ops.adam import ...` fails
    loudly at initialize instead of mixing the libraries."""
    code = """
import slipstream as deepspeed, torch
from tests.compat._deepspeed import import_deepspeed
real = import_deepspeed()
from deepspeed.runtime.lr_schedules import WarmupLR
model = torch.nn.Linear(2, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
try:
    deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=WarmupLR(opt),
                         config={"train_micro_batch_size_per_gpu": 1})
except TypeError as e:
    print(e)
"""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k != "SLIPSTREAM_AS_DEEPSPEED"}
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "lr_scheduler is a deepspeed.runtime.lr_schedules.WarmupLR from the real DeepSpeed" in (
        proc.stdout
    )
    assert "SLIPSTREAM_AS_DEEPSPEED=1" in proc.stdout
