"""Issue 38: a rank that dies as ``save_checkpoint`` starts is named as dead by the survivor
(it read as a usage error: "not every rank called it within 300 s ... must be called on
every rank"). Two real processes, one exiting at the call; each has a timeout."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_RANK = """
import os, sys, torch
import slipstream
from slipstream.checkpoint import CheckpointError
from slipstream.models import GPT, GPTConfig
torch.manual_seed(0)
config = {"train_micro_batch_size_per_gpu": 1,
          "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
engine = slipstream.initialize(model=GPT(GPTConfig.preset("tiny")), config=config)[0]
if engine.global_rank == 1:
    os._exit(3)  # dies as save_checkpoint starts
try:
    engine.save_checkpoint(sys.argv[1])
except CheckpointError as e:
    print("ERROR", e, flush=True)
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_rank_dying_at_save_is_named_dead_not_missing(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()),
               OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))  # fmt: skip
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(tmp_path / "ckpt")],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert procs[1].returncode == 3, outs[1]
    line = next((ln for ln in outs[0].splitlines() if ln.startswith("ERROR")), outs[0][-2000:])
    assert "save_checkpoint: rank 1 is gone: its connection closed" in line, line
    assert "(its process died, or its script ended without calling save_checkpoint)" in line
    assert "nothing was written" in line, line
    assert "within 300 s" not in line and "not only on rank 0" not in line, line
