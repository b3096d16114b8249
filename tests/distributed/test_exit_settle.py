"""Issue 38: at exit, slipstream waits (GIL released) for gloo's threads to finish their last
work items before the interpreter finalizes; a worker freeing a tensor during finalization
aborted the process ("terminate called without an active exception", exit 134).
``benchmarks/soak_exit.py`` is the soak; these tests pin the detection and the wait."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
import time

import pytest

from slipstream.distributed import _exit, comm

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _spin_as(name: bytes, stop: threading.Event) -> None:
    ctypes.CDLL(None).prctl(15, name, 0, 0, 0)  # PR_SET_NAME: this thread's name in /proc
    while not stop.is_set():
        pass


@linux
def test_settle_waits_while_a_gloo_thread_is_runnable() -> None:
    """A runnable thread named as gloo's workers holds the wait until it stops (or the
    timeout ends it); with none runnable the wait ends within a few polls."""
    assert comm.settle_comm_threads(timeout_s=1.0)
    stop = threading.Event()
    spinner = threading.Thread(target=_spin_as, args=(b"pt_gloo_runloop", stop), daemon=True)
    spinner.start()
    try:
        time.sleep(0.05)
        assert _exit._runnable_comm_threads() >= 1
        t0 = time.monotonic()
        assert not comm.settle_comm_threads(timeout_s=0.3)
        assert time.monotonic() - t0 >= 0.3
    finally:
        stop.set()
        spinner.join()
    t0 = time.monotonic()
    assert comm.settle_comm_threads(timeout_s=1.0)
    assert time.monotonic() - t0 < 0.5


_SCRIPT = """
import sys, torch, torch.distributed as dist
from slipstream.distributed import _exit, comm
calls = []
real = comm.settle_comm_threads
comm.settle_comm_threads = lambda *a, **k: calls.append(real(*a, **k))
import atexit
atexit.register(lambda: print("settled", calls, flush=True))  # runs after comm's hook
comm.init_distributed("gloo")
for _ in range(3):
    dist.all_gather_object([None], {"tag": "x" * 64})
"""


def test_exit_settles_after_destroying_the_process_group(tmp_path) -> None:
    """The exit hook init_distributed registers destroys the group, then settles the
    threads; the process exits 0."""
    script = tmp_path / "exit.py"
    script.write_text(_SCRIPT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "settled [True]" in out.stdout, out.stdout + out.stderr[-2000:]


def _pending_gather_at_exit(outdir: str) -> None:
    """Rank 0 exits with an all-gather in flight that rank 1 never joins; rank 1 stays alive
    (in an exit hook) until rank 0's exit hooks are done, or 15 s."""
    import atexit
    import logging
    from pathlib import Path

    import torch.distributed as dist

    import slipstream
    from slipstream.models import GPT, GPTConfig

    os.environ["SLIPSTREAM_EXIT_TIMEOUT"] = "1"
    done = Path(outdir) / "rank0-done"
    rank = dist.get_rank()
    config = {
        "train_batch_size": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine = slipstream.initialize(model=GPT(GPTConfig.preset("tiny")), config=config)[0]
    times: dict[str, float] = {}
    if rank == 0:
        handler = logging.FileHandler(Path(outdir) / "rank0.log")
        logging.getLogger("slipstream").addHandler(handler)
        atexit.register(lambda: done.write_text(f"{time.monotonic() - times['start']:.2f}"))
    atexit.register(comm._shutdown)  # as init_distributed registers it (the harness made the group)
    if rank == 0:
        store = engine.optimizer.store
        unit = next(u for u in store.units if u.buckets and not u.gathered)
        store._check_same_unit = lambda unit: None  # (a collective rank 1 would join)
        store._start_gather(unit)  # a prefetch rank 1 never issues
        atexit.register(lambda: times.setdefault("start", time.monotonic()))
    else:
        stop = time.monotonic() + 15
        atexit.register(
            lambda: [
                time.sleep(0.05)
                for _ in iter(lambda: done.exists() or time.monotonic() > stop, True)
            ]
        )
    globals()["_engine"] = engine  # held to the end, as a script's global is


def test_exit_waits_for_work_in_flight_at_most_the_exit_timeout(tmp_path) -> None:
    """A prefetch all-gather still in flight at exit whose peer neither joins it nor exits
    (a stalled or starved rank) holds the exit hooks SLIPSTREAM_EXIT_TIMEOUT seconds at most,
    with a warning naming the all-gather; it used to wait for the peer (or the 600 s
    collective timeout)."""
    from tests.distributed.harness import run_world

    run_world(_pending_gather_at_exit, 2, str(tmp_path), timeout_s=120)
    took = float((tmp_path / "rank0-done").read_text())
    log = (tmp_path / "rank0.log").read_text()
    assert "gave up waiting for the all-gather of parameter unit" in log, log
    assert took < 12, f"rank 0's exit hooks took {took} s"  # before: >= 15 s (rank 1 exits)


_STUCK = """
import time
from slipstream.distributed import comm
comm.init_distributed("gloo")
class Stuck:
    def __del__(self):  # a teardown that never ends (a C++ destructor joining a busy thread)
        time.sleep(600)
stuck = Stuck()
stuck.cycle = stuck  # freed by the garbage collection of interpreter finalization
del stuck
import gc
gc.disable()
"""


@linux
def test_a_stuck_teardown_after_the_exit_hooks_is_ended_with_a_message(tmp_path) -> None:
    """Interpreter finalization stuck after slipstream's exit hooks: the watchdog they arm
    ends the process after SLIPSTREAM_EXIT_TIMEOUT seconds, saying so on its stderr."""
    script = tmp_path / "stuck.py"
    script.write_text(_STUCK)
    env = dict(os.environ, SLIPSTREAM_EXIT_TIMEOUT="2")
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == -9, (out.returncode, out.stderr[-2000:])
    assert "this process (pid" in out.stderr, out.stderr[-2000:]
    assert "still alive 2 s after its exit hooks finished" in out.stderr, out.stderr[-2000:]
    assert "SLIPSTREAM_EXIT_TIMEOUT" in out.stderr
    assert time.monotonic() - t0 < 200


def test_a_bad_exit_timeout_is_refused_when_the_job_starts(monkeypatch) -> None:
    monkeypatch.setenv("SLIPSTREAM_EXIT_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="SLIPSTREAM_EXIT_TIMEOUT='soon': expected seconds"):
        _exit.exit_timeout_s()
    monkeypatch.setenv("SLIPSTREAM_EXIT_TIMEOUT", "0")
    assert _exit.exit_timeout_s() == 0
    assert _exit.arm_exit_watchdog(0, "this process") is None
