"""Issue 38: a rank that dies as ``save_checkpoint`` starts is named as dead by the survivor
(it read as a usage error: "not every rank called it within 300 s ... must be called on
every rank"). Two processes, one exiting at the call; each has a timeout."""

from __future__ import annotations

import os
import socket
from concurrent.futures import ThreadPoolExecutor

from tests.distributed.harness import run_code

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
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()),
               OMP_NUM_THREADS="1")  # fmt: skip
    code = _RANK.replace("sys.argv[1]", repr(str(tmp_path / "ckpt")))
    # Two processes forked warm (run_code), started together; each has its timeout.
    with ThreadPoolExecutor(2) as pool:
        runs = [
            pool.submit(
                run_code, code, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, timeout_s=240
            )
            for r in range(2)
        ]
        procs = [run.result() for run in runs]
    outs = [p.stdout + p.stderr for p in procs]
    assert procs[1].returncode == 3, outs[1]
    line = next((ln for ln in outs[0].splitlines() if ln.startswith("ERROR")), outs[0][-2000:])
    assert "save_checkpoint: rank 1 is gone: its connection closed" in line, line
    assert "(its process died, or its script ended without calling save_checkpoint)" in line
    assert "nothing was written" in line, line
    assert "within 300 s" not in line and "not only on rank 0" not in line, line
