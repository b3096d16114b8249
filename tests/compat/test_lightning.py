"""Lightning's ``DeepSpeedStrategy`` (stages 2 and 3) on slipstream under
SLIPSTREAM_AS_DEEPSPEED=1, 2 CPU processes launched by Lightning: the same losses as
Lightning's DDP on the same data and seed (fp32, 1e-5). Lightning is not a dev dependency:
without it the test skips. Each run takes 1-5 minutes on 2 busy cores (Lightning starts its
second process itself).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "lightning_fit.py"

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("lightning") is None, reason="Lightning is not installed"
)


def _fit(tmp_path: Path, strategy: str, stage: int, switch: bool) -> list[float]:
    out = tmp_path / f"{strategy}{stage}{int(switch)}.json"
    env = {k: v for k, v in os.environ.items() if k != "SLIPSTREAM_AS_DEEPSPEED"}
    env["OMP_NUM_THREADS"] = "1"
    if switch:
        env["SLIPSTREAM_AS_DEEPSPEED"] = "1"
    cmd = [sys.executable, str(SCRIPT), "--strategy", strategy, "--stage", str(stage)]
    proc = subprocess.run(
        [*cmd, "--out", str(out)], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    got = json.loads(out.read_text())
    assert got["steps"] == len(got["losses"]) > 0
    return [float(x) for x in got["losses"]]


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    return _fit(tmp_path_factory.mktemp("ddp"), "ddp", 0, switch=False)


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_strategy_trains_like_ddp(tmp_path: Path, ddp: list[float], stage: int) -> None:
    got = _fit(tmp_path, "deepspeed", stage, switch=True)
    assert got == pytest.approx(ddp, rel=1e-5, abs=1e-7)
