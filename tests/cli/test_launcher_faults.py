"""`slipstream run` under faults: workers die with a SIGKILLed launcher, the rank that failed
first is named and the ranks that failed only because a peer died are listed as secondary."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from slipstream.cli._failures import classify_failures, format_report, job_exit_status
from slipstream.cli._rank_entry import LAUNCHER_PID_ENV
from slipstream.cli.main import main
from tests.cli.test_launcher import REPO, SCRIPTS, slipstream
from tests.distributed.harness import cli_main, run_fresh, start_fresh

RANK_ENTRY = str(REPO / "slipstream" / "cli" / "_rank_entry.py")
PEER_FAULT = str(SCRIPTS / "peer_fault.py")
PEER_SOCKET = str(SCRIPTS / "peer_socket.py")
SLEEPER = str(SCRIPTS / "fail_rank1.py")
GLOO_RESET = (
    "RuntimeError: [../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:5507: "
    "Connection reset by peer. This is typically caused by a remote worker hanging"
)


def gone(pid: int) -> bool:
    """True when ``pid`` has exited; a zombie counts (an orphan's reaper may be lazy)."""
    try:
        with open(f"/proc/{pid}/stat") as fp:
            return fp.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def wait_for_files(paths: list[Path], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"timed out waiting for {paths}"
        time.sleep(0.05)


def report_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("slipstream run: rank")]


# --- item 3: the workers die with their launcher ---------------------------------------------


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal: Linux")
def test_sigkilled_launcher_takes_its_workers_along(tmp_path):
    """SIGKILL the launcher of 2 sleeping ranks: both worker pids are gone within 5 s."""
    env = {**os.environ}
    env.pop("OMP_NUM_THREADS", None)
    (tmp_path / "launcher").mkdir()
    launcher = start_fresh(  # `slipstream run`, forked warm
        cli_main, ["run", "--nproc", "2", SLEEPER, str(tmp_path), "sleep"],
        outdir=str(tmp_path / "launcher"), env=env, cwd=REPO,
    )  # fmt: skip
    try:
        pid_files = [tmp_path / "rank0.pid", tmp_path / "rank1.pid"]
        wait_for_files(pid_files, timeout=90)
        pids = [int(p.read_text()) for p in pid_files]
        assert not any(gone(pid) for pid in pids)
        launcher.kill()
        launcher.join(timeout=10)
        deadline = time.monotonic() + 5
        while not all(gone(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [pid for pid in pids if not gone(pid)] == []
    finally:
        launcher.kill()
        for p in tmp_path.glob("rank*.pid"):
            if not gone(int(p.read_text())):
                os.kill(int(p.read_text()), signal.SIGKILL)


def test_worker_whose_launcher_is_already_gone_kills_itself(tmp_path):
    """The race between fork and prctl: a parent that is not the launcher means it died."""
    script = tmp_path / "ok.py"
    script.write_text("print('ran')\n")
    run = [sys.executable, RANK_ENTRY, "--no_local_rank", str(script)]
    orphan = subprocess.run(run, env={**os.environ, LAUNCHER_PID_ENV: "1"}, capture_output=True)
    assert orphan.returncode == -signal.SIGKILL
    assert b"ran" not in orphan.stdout
    ours = subprocess.run(run, env={**os.environ, LAUNCHER_PID_ENV: str(os.getpid())},
                          capture_output=True, text=True)  # fmt: skip
    assert ours.returncode == 0 and ours.stdout == "ran\n"


# --- item 4: which rank is blamed ------------------------------------------------------------


def error_file(path: Path, message: str, when: float) -> str:
    """An error file as _rank_entry writes it."""
    extra = {"py_callstack": "...", "timestamp": str(int(when)), "time": repr(when)}
    path.write_text(json.dumps({"message": {"message": message, "extraInfo": extra}}))
    return str(path)


def test_killed_rank_is_the_cause_although_the_survivor_failed_earlier_on_the_clock(tmp_path):
    """torchelastic stamps a killed rank when it notices it, in whole seconds, after the
    survivor's own error: a peer-lost error must still never be named as the cause."""
    survivor = ProcessFailure(
        local_rank=0, pid=100, exitcode=1,
        error_file=error_file(tmp_path / "e0.json", GLOO_RESET, time.time() - 5),
    )  # fmt: skip
    killed = ProcessFailure(local_rank=1, pid=101, exitcode=-9, error_file="<none>")
    assert survivor.timestamp < killed.timestamp  # what fooled get_first_failure
    failures = classify_failures({0: survivor, 1: killed}, stops={})
    assert [(f.rank, f.kind) for f in failures] == [(1, "primary"), (0, "secondary")]
    lines = format_report(failures, None)
    assert lines[0].startswith("slipstream run: rank 1 (local rank 1, pid 101) was killed by ")
    assert "SIGKILL (exit code 137); no Python traceback recorded" in lines[0]
    assert lines[1].startswith("slipstream run: rank 0 (local rank 0) failed only because a peer")
    assert "Connection reset by peer" in lines[1]


def test_ranks_the_launcher_stopped_are_not_causes(tmp_path):
    """A rank SIGTERMed by the agent after another failed is 'stopped', even if it died first
    on the clock; one that raised before the stop is still a primary failure."""
    now = time.time()
    stopped = ProcessFailure(local_rank=0, pid=200, exitcode=-15, error_file="<none>")
    raised = ProcessFailure(
        local_rank=1, pid=201, exitcode=-15,  # raised, then the agent's SIGTERM came first
        error_file=error_file(tmp_path / "e1.json", "ValueError: bad batch", now + 30),
    )  # fmt: skip
    failures = classify_failures({0: stopped, 1: raised}, stops={200: now, 201: now + 60})
    assert [(f.rank, f.kind) for f in failures] == [(1, "primary"), (0, "stopped")]
    assert len(format_report(failures, None)) == 1


def test_first_raise_is_the_cause_and_its_exit_code_the_jobs_though_sigtermed(tmp_path):
    """Issue 38: both ranks raise (ranks that build different models); rank 1 raised first
    but was still exiting when rank 0's exit made the launcher SIGTERM it. The report names
    rank 1's exception, not 'killed by SIGTERM', and the job exits 1 (rank 0's own code),
    not 143."""
    now = time.time()
    first = ProcessFailure(
        local_rank=1, pid=401, exitcode=-15,
        error_file=error_file(tmp_path / "e1.json", "RuntimeError: model differs", now),
    )  # fmt: skip
    second = ProcessFailure(
        local_rank=0, pid=400, exitcode=1,
        error_file=error_file(tmp_path / "e0.json", "RuntimeError: model differs", now + 0.01),
    )  # fmt: skip
    failures = classify_failures({0: second, 1: first}, stops={401: now + 0.5})
    assert (failures[0].rank, failures[0].kind) == (1, "primary")
    (line, *_) = format_report(failures, None)
    assert "rank 1 (local rank 1, pid 401) failed (it raised, then the launcher's SIGTERM" in line
    assert "RuntimeError: model differs" in line and "exit code 143" not in line
    assert job_exit_status(failures) == 1
    # A rank the launcher stopped with nothing raised never sets the code.
    killed = ProcessFailure(local_rank=0, pid=402, exitcode=-9, error_file="<none>")
    assert job_exit_status(classify_failures({0: killed}, stops={})) == 137


def test_only_secondary_failures_say_no_rank_was_seen_first(tmp_path):
    lost = ProcessFailure(
        local_rank=0, pid=300, exitcode=1,
        error_file=error_file(tmp_path / "e.json", GLOO_RESET, time.time()),
    )  # fmt: skip
    (line,) = format_report(classify_failures({0: lost}, stops={}), None)
    assert "rank 0 (local rank 0, pid 300) failed with exit code 1" in line
    assert "lost its connection to a peer, but no rank was seen failing before it" in line


def test_sigkilled_rank_is_named_not_its_peer_with_gloo(tmp_path):
    """Rank 0 SIGKILLs itself mid-job; rank 1 then fails in gloo: rank 0 is the cause."""
    result = _run_peer_fault(tmp_path, "kill0")
    assert result.returncode == 137, result.stderr
    lines = report_lines(result.stderr)
    assert lines[0].startswith("slipstream run: rank 0 (local rank 0, pid "), lines
    assert "was killed by SIGKILL (exit code 137)" in lines[0]
    # rank 1 either failed on the lost connection or was stopped before it could.
    assert all("rank 1 (local rank 1) failed only because a peer died" in ln for ln in lines[1:])


def _run_peer_fault(tmp: Path, mode: str) -> subprocess.CompletedProcess[str]:
    return slipstream("run", "--nproc", "2", PEER_FAULT, str(tmp), mode, timeout=120)


def test_python_error_on_rank0_is_named_and_rank1_listed_as_secondary(tmp_path):
    result = _run_peer_fault(tmp_path, "raise0")
    assert result.returncode == 1, result.stderr
    lines = report_lines(result.stderr)
    assert lines[0].startswith("slipstream run: rank 0 (local rank 0, pid "), lines
    assert "failed with exit code 1; ValueError: rank 0 broke on purpose; traceback in" in lines[0]
    assert all("rank 1 (local rank 1) failed only because a peer died" in ln for ln in lines[1:])


def _five_races(root: str) -> None:
    """One launcher process running five jobs in turn (victims 0, 1, 0, 1, 0)."""
    for i, victim in enumerate([0, 1, 0, 1, 0]):
        out = os.path.join(root, str(i))
        os.mkdir(out)
        code = main(["run", "--nproc", "2", PEER_SOCKET, out, str(victim)])
        print(f"=== {victim} {code}", file=sys.stderr, flush=True)


def test_killed_rank_is_named_every_time_over_repeated_races(tmp_path):
    """Five jobs whose survivor fails within milliseconds of its peer's SIGKILL (the race that
    blamed the survivor 2 times in 16): the killed rank is the cause in every one."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = run_fresh(_five_races, str(tmp_path), env=env, cwd=REPO, timeout_s=180)
    assert result.returncode == 0, result.stderr[-3000:]
    jobs = result.stderr.split("=== ")
    runs = [(job, part) for job, part in zip(jobs[1:], jobs[:-1], strict=True)]
    assert len(runs) == 5
    for marker, text in runs:
        victim, code = map(int, marker.split()[:2])
        lines = report_lines(text)
        assert code == 137, text[-2000:]
        assert lines[0].startswith(f"slipstream run: rank {victim} (local rank {victim}, pid ")
        assert "was killed by SIGKILL" in lines[0]
        for line in lines[1:]:
            assert f"rank {1 - victim} (local rank {1 - victim}) failed only because" in line
