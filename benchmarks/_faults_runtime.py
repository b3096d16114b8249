"""Runtime rows of the fault matrix (``benchmarks/faults.py``): the launcher, stalled and
killed ranks, non-finite losses, bad config types, released ZeRO-3 parameters and exit codes.

Each case runs a small script through ``slipstream run`` (or plain ``python``) in fresh
processes and reports, as the checkpoint rows do, the seconds from the fault to the clean
error (or to the end of the job), whether training state was lost or corrupted, and the
first line a user sees.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

_GPT = """
import os, sys, torch
import slipstream
from slipstream.models import GPT, GPTConfig

def engine(stage=3, zero=None, **extra):
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", dropout=0.0))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 8 // world,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": stage, **(zero or {})}, **extra}
    return slipstream.initialize(model=model, config=config)[0]

def batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 256, (4, 17), generator=g)
    return x[:, :-1], x[:, 1:]
"""

# Fault scripts, run on every rank with --local_rank passed first (ignored).
_SCRIPTS = {
    "sleeper": """
import os, sys, time
open(os.path.join(sys.argv[-1], f"pid.{os.environ['RANK']}"), "w").write(str(os.getpid()))
while True:
    time.sleep(0.2)
""",
    "allreduce_loop": """
import os, sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
open(os.path.join(sys.argv[-1], f"pid.{dist.get_rank()}"), "w").write(str(os.getpid()))
t = torch.ones(4)
while True:
    dist.all_reduce(t)
    time.sleep(0.02)
""",
    "stall": _GPT
    + """
e = engine(stage=2)
for step in range(3):
    if step == 1 and e.global_rank == 1:
        open(os.path.join(sys.argv[-1], "stalled_at"), "w").write(repr(__import__("time").time()))
        os.kill(os.getpid(), 19)  # SIGSTOP: a rank that stops answering mid-training
    x, y = batch(step)
    e.backward(e(x, y)); e.step()
""",
    "nan_loss": _GPT
    + """
prec = sys.argv[-2]
e = engine(stage=3, **({"bf16": {"enabled": True}} if prec == "bf16" else {}))
for step in range(3):
    x, y = batch(step)
    loss = e(x, y)
    if step == 1 and e.global_rank == 1:
        loss = loss * float("nan")  # one rank's loss goes bad
    e.backward(loss); e.step()
from slipstream.zero import GatheredParameters
with GatheredParameters(list(e.module.parameters())):
    finite = all(bool(torch.isfinite(p).all()) for p in e.module.parameters())
if e.global_rank == 0:
    print(f"RESULT finite={finite} skipped={e.skipped_steps}", flush=True)
""",
    "released_param": _GPT
    + """
e = engine(stage=3, zero={"stage3_param_persistence_threshold": 0})
x, y = batch(0)
e.backward(e(x, y)); e.step()
p = next(e.module.layers[0].parameters())
total = sum(float(q.norm()) for q in e.module.parameters())  # logging norms
text = repr(p) + str(bool(torch.isnan(p).any())) + str(p.clone().sum())
if e.global_rank == 0:
    print(f"RESULT ok: norm, repr, isnan, clone of released parameters; shape={tuple(p.shape)} ds_shape={tuple(p.ds_shape)} ds_status={p.ds_status.name}", flush=True)
""",
    "resume": _GPT
    + """
d = sys.argv[-1]
e = engine(stage=3)
if os.path.exists(os.path.join(d, "ckpt", "latest")):
    e.load_checkpoint(os.path.join(d, "ckpt"))
for step in range(2):
    x, y = batch(step)
    e.backward(e(x, y)); e.step()
if not os.path.exists(os.path.join(d, "ckpt", "latest")):
    e.save_checkpoint(os.path.join(d, "ckpt"))
""",
}


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env["SLIPSTREAM_LOG_LEVEL"] = "WARNING"
    return env


def _launch(
    scratch: Path, script: str, *args: str, nproc: int = 2, run_args: tuple[str, ...] = ()
) -> subprocess.Popen[str]:
    path = scratch / f"{script}.py"
    path.write_text(textwrap.dedent(_SCRIPTS[script]))
    cmd = [sys.executable, "-m", "slipstream.cli.main", "run", "--nproc", str(nproc), *run_args,
           str(path), *args, str(scratch)]  # fmt: skip
    return subprocess.Popen(
        cmd, cwd=scratch, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _finish(proc: subprocess.Popen[str], timeout_s: float) -> tuple[int | None, str]:
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        proc.kill()  # the workers die with it (parent-death signal)
        out, _ = proc.communicate()
        return None, out


def _report_line(out: str) -> str:
    lines = [t for t in out.splitlines() if t.startswith("slipstream run: rank")]
    return lines[0] if lines else (out.strip().splitlines() or ["(no output)"])[-1]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fp:
            return fp.read().split(") ")[1][0] != "Z"  # a zombie is dead, only unreaped
    except (FileNotFoundError, IndexError):
        return False


def _wait_pids(scratch: Path, n: int, timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        files = sorted(scratch.glob("pid.*"))
        if len(files) == n and all(f.read_text() for f in files):
            return [int(f.read_text()) for f in files]
        time.sleep(0.1)
    raise TimeoutError(f"workers did not start within {timeout_s:.0f} s")


def launcher_sigkill(scratch: Path, timeout_s: float, result: Any) -> list[Any]:
    proc = _launch(scratch, "sleeper")
    pids = _wait_pids(scratch, 2, timeout_s)
    t0 = time.monotonic()
    proc.kill()
    proc.wait()
    while any(_alive(p) for p in pids) and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    left = [p for p in pids if _alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    took = time.monotonic() - t0
    outcome = f"orphans still running: {left}" if left else f"both workers gone in {took:.2f} s"
    return [result("launcher-sigkill", took, False, outcome, not left)]


def rank_kill(scratch: Path, timeout_s: float, result: Any) -> list[Any]:
    proc = _launch(scratch, "allreduce_loop")
    pids = _wait_pids(scratch, 2, timeout_s)
    time.sleep(0.5)
    t0 = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    code, out = _finish(proc, timeout_s)
    line = _report_line(out)
    ok = code not in (0, None) and line.startswith("slipstream run: rank 1 ")
    return [result("rank-sigkill-blame", time.monotonic() - t0, False, line, ok)]


def stalled_rank(scratch: Path, timeout_s: float, result: Any) -> list[Any]:
    proc = _launch(scratch, "stall", run_args=("--comm_timeout", "5"))
    code, out = _finish(proc, timeout_s)
    stamp = scratch / "stalled_at"
    took = time.time() - float(stamp.read_text()) if stamp.exists() else None
    msg = next((t for t in out.splitlines() if "CollectiveTimeoutError:" in t), "")
    line = msg.split("CollectiveTimeoutError:", 1)[-1].strip()[:200] or _report_line(out)
    ok = code not in (0, None) and "rank 1" in out and "did not arrive" in out
    return [result("stalled-rank (timeout 5 s)", took, False, line, ok)]


def nan_loss(precision: str) -> Callable[[Path, float, Any], list[Any]]:
    def run(scratch: Path, timeout_s: float, result: Any) -> list[Any]:
        t0 = time.monotonic()
        code, out = _finish(_launch(scratch, "nan_loss", precision), timeout_s)
        got = re.search(r"RESULT finite=(\w+) skipped=(\d+)", out)
        warn = next((t for t in out.splitlines() if "skipped" in t and "step" in t), "")
        lost = not (got and got.group(1) == "True")
        ok = code == 0 and not lost and got is not None and got.group(2) == "1" and bool(warn)
        line = warn.strip()[:200] or _report_line(out)
        return [result(f"nan-loss-one-rank ({precision})", None, lost, line, ok,
                       {"seconds_total": time.monotonic() - t0})]  # fmt: skip

    return run


def bad_config_type(scratch: Path, timeout_s: float, result: Any) -> list[Any]:
    code = (
        "import slipstream, torch\n"
        "t = __import__('time').perf_counter()\n"
        "try:\n"
        "    slipstream.initialize(model=torch.nn.Linear(2, 2), config={'train_batch_size': 2,"
        " 'optimizer': {'type': 'Adam', 'params': {'lr': 1e-3}},"
        " 'zero_optimization': {'stage': '2'}})\n"
        "except Exception as e:\n"
        "    print(f'ERR {__import__(\"time\").perf_counter() - t:.4f} {type(e).__name__}: {e}')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=scratch, env=_env(), capture_output=True, text=True,
        timeout=timeout_s,
    ).stdout  # fmt: skip
    got = re.search(r"ERR ([\d.]+) (.*)", out)
    line = got.group(2)[:200] if got else out.strip()[-200:]
    ok = bool(got) and "zero_optimization.stage" in line and "string" in line
    return [result("config-type ('stage': '2')", float(got.group(1)) if got else None, False,
                   line, ok)]  # fmt: skip


def released_param(scratch: Path, timeout_s: float, result: Any) -> list[Any]:
    code, out = _finish(_launch(scratch, "released_param"), timeout_s)
    got = re.search(r"RESULT .*", out)
    line = got.group(0) if got else _report_line(out)
    return [result("zero3-released-param-read", None, False, line, code == 0 and bool(got))]


def exit_codes(repeats: int) -> Callable[[Path, float, Any], list[Any]]:
    def run(scratch: Path, timeout_s: float, result: Any) -> list[Any]:
        codes: list[int | None] = []
        t0 = time.monotonic()
        for _ in range(repeats + 1):  # the first run saves, the others resume
            code, out = _finish(_launch(scratch, "resume"), timeout_s)
            codes.append(code)
            if code != 0 and "terminate called" not in out:
                break
        resumed = codes[1:]
        bad = [c for c in resumed if c != 0]
        outcome = f"{len(resumed) - len(bad)}/{len(resumed)} resumed ZeRO-3 runs exit 0"
        if bad:
            outcome += f"; other exit codes {bad}"
        return [result(f"exit-after-zero3-resume x{repeats}", None, False, outcome,
                       not bad and codes[0] == 0,
                       {"codes": codes, "seconds_total": time.monotonic() - t0})]  # fmt: skip

    return run


def register_runtime(register: Any, case_type: Any, result: Any, repeats: int = 50) -> None:
    """Add the runtime rows to the matrix (``repeats``: resumed runs of the exit-code row)."""

    def add(name: str, desc: str, fn: Callable[[Path, float, Any], list[Any]]) -> None:
        register(case_type(name, desc, lambda s, t, _p: fn(s, t, result)))

    add("launcher-sigkill", "SIGKILL the launcher: do its workers die?", launcher_sigkill)
    add("rank-sigkill", "SIGKILL rank 1 mid-collective: is it the one named?", rank_kill)
    add("stalled-rank", "rank 1 SIGSTOPs itself: time to an error naming it", stalled_rank)
    add("nan-loss-fp32", "NaN loss on one rank at step 2 (fp32, ZeRO-3)", nan_loss("fp32"))
    add("nan-loss-bf16", "NaN loss on one rank at step 2 (bf16, ZeRO-3)", nan_loss("bf16"))
    add("config-type", "a string where the stage number goes", bad_config_type)
    add("zero3-released", "norm/print/isnan of released ZeRO-3 parameters", released_param)
    add("exit-codes", f"{repeats} resumed ZeRO-3 runs: exit codes", exit_codes(repeats))
