"""Issue 38: at exit, slipstream waits (GIL released) for gloo's threads to finish their last
work items before the interpreter finalizes; a worker freeing a tensor during finalization
aborted the process ("terminate called without an active exception", exit 134).
``benchmarks/soak_exit.py`` is the soak; these tests pin the detection and the wait."""

from __future__ import annotations

import ctypes
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
