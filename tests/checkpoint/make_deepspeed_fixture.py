"""Regenerate ``deepspeed_fixture/``: a ZeRO-2 checkpoint DeepSpeed 0.19.8 wrote at world 2
(fp32, CPU; about 12 KB) and DeepSpeed's own losses for the steps after it; and
``deepspeed_moe_fixture/``: the same for a model with a ``deepspeed.moe`` layer at ep_size 2
(``_deepspeed_moe_workloads``; about 40 KB); and ``deepspeed_pipe_fixture/``: a 2-stage
``PipelineModule`` at ZeRO-1 (``_deepspeed_pipe_workloads``; about 20 KB).

It lets ``test_from_deepspeed`` check the reading of DeepSpeed's layout where DeepSpeed is not
installed (CI installs ``[dev]`` only); where it is, the tests run DeepSpeed itself.
Run from the repository root with DeepSpeed installed::

    DS_ACCELERATOR=cpu python -m tests.checkpoint.make_deepspeed_fixture
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from tests.checkpoint import _deepspeed_moe_workloads as mw
from tests.checkpoint import _deepspeed_pipe_workloads as pw
from tests.checkpoint import _deepspeed_workloads as w
from tests.distributed.harness import run_world

FIXTURE = Path(__file__).parent / "deepspeed_fixture"
MOE_FIXTURE = Path(__file__).parent / "deepspeed_moe_fixture"
PIPE_FIXTURE = Path(__file__).parent / "deepspeed_pipe_fixture"
CASE = (2, False)


def main() -> None:
    dense()
    moe()
    pipe()


def dense() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        losses = run_world(w.deepspeed_runs, w.DS_WORLD, tmp, [CASE], timeout_s=600)[0][CASE]
        shutil.rmtree(FIXTURE, ignore_errors=True)
        # The checkpoint only: not the recovery scripts DeepSpeed copies beside it.
        shutil.copytree(Path(tmp) / "ds_s2", FIXTURE, ignore=shutil.ignore_patterns("*.py"))
    (FIXTURE / "expected.json").write_text(
        json.dumps({"deepspeed": "0.19.8", "stage": CASE[0], "losses": losses}, indent=1) + "\n"
    )
    print(f"wrote {FIXTURE}: {sorted(p.name for p in FIXTURE.rglob('*'))}")


def moe() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        losses = run_world(mw.deepspeed_runs, mw.DS_WORLD, tmp, [(2, 2)], timeout_s=600)[0][(2, 2)]
        shutil.rmtree(MOE_FIXTURE, ignore_errors=True)
        shutil.copytree(
            Path(tmp) / "ds_moe_ep2", MOE_FIXTURE, ignore=shutil.ignore_patterns("*.py")
        )
    (MOE_FIXTURE / "expected.json").write_text(
        json.dumps({"deepspeed": "0.19.8", "stage": 2, "ep_size": 2, "losses": losses}, indent=1)
        + "\n"
    )
    print(f"wrote {MOE_FIXTURE}: {sorted(p.name for p in MOE_FIXTURE.rglob('*'))}")


def pipe() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        losses = run_world(pw.deepspeed_runs, 2, tmp, [1], timeout_s=600)[0][1]
        shutil.rmtree(PIPE_FIXTURE, ignore_errors=True)
        shutil.copytree(
            Path(tmp) / "ds_pipe_s1", PIPE_FIXTURE, ignore=shutil.ignore_patterns("*.py")
        )
    (PIPE_FIXTURE / "expected.json").write_text(
        json.dumps({"deepspeed": "0.19.8", "stage": 1, "pp": 2, "losses": losses}, indent=1) + "\n"
    )
    print(f"wrote {PIPE_FIXTURE}: {sorted(p.name for p in PIPE_FIXTURE.rglob('*'))}")


if __name__ == "__main__":
    main()
