"""``accelerate launch --use_deepspeed --deepspeed_config_file`` at 2 processes runs an
Accelerate loop on slipstream's engine under SLIPSTREAM_AS_DEEPSPEED=1; with DeepSpeed
installed the losses equal DeepSpeed 0.19.8's."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.compat import _hf_workloads as w

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

SCRIPT = Path(__file__).parent / "scripts" / "accelerate_train.py"
CONFIG = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 2},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(tmp: Path, name: str, env: dict[str, str]) -> dict[str, Any]:
    out = tmp / f"{name}.json"
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--num_processes=2",
        "--num_machines=1",
        f"--main_process_port={_free_port()}",
        "--use_deepspeed",
        f"--deepspeed_config_file={tmp / 'ds_config.json'}",
        "--mixed_precision=no",
        str(SCRIPT),
        str(tmp / "tiny-gpt2"),
        str(out),
    ]
    base = {k: v for k, v in os.environ.items() if k != "SLIPSTREAM_AS_DEEPSPEED"}
    proc = subprocess.run(
        cmd,
        env={**base, "OMP_NUM_THREADS": "1", **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("accelerate")
    w.save_tiny_gpt2(str(path / "tiny-gpt2"))
    (path / "ds_config.json").write_text(json.dumps(CONFIG))
    return path


@pytest.fixture(scope="module")
def ours(tmp: Path) -> dict[str, Any]:
    return _launch(tmp, "slipstream", {"SLIPSTREAM_AS_DEEPSPEED": "1"})


def test_accelerate_launch_trains_on_slipstream(ours: dict[str, Any]) -> None:
    assert ours["engine"] == "slipstream.runtime.engine"
    assert len(ours["losses"]) >= 2


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")
def test_accelerate_launch_equals_deepspeed(tmp: Path, ours: dict[str, Any]) -> None:
    theirs = _launch(tmp, "deepspeed", {"DS_ACCELERATOR": "cpu"})
    assert theirs["engine"] == "deepspeed.runtime.engine"
    assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-5)
