"""Exit soak: many save-then-exit cycles of a 2-rank ZeRO-3 job, counting exit codes.

Usage::

    python benchmarks/soak_exit.py --cycles 300                 # the regression soak
    python benchmarks/soak_exit.py --cycles 40 --busy 2         # with a busy loop per core
    python benchmarks/soak_exit.py --cycles 100 --cores --keep /tmp/soak   # keep core dumps
    python benchmarks/soak_exit.py --mode fork --cycles 2000 --minutes 30  # as many as fit

Each cycle is one 2-rank job of a tiny GPT at ZeRO-3 (gloo on CPU) that loads the previous
cycle's checkpoint when there is one, trains two steps, saves a checkpoint (synchronously, or
with ``checkpoint.async_save``, alternating by default; tags alternate between two names, so
every save after the second reuses a tag), calls ``engine.destroy()`` and exits. The abort
this catches ("terminate called without an active exception", exit 134) came from C++
teardown after the exit hooks, about once in 70 such launches; a run that ends any other way
than exit 0 is listed with the last lines of its output.

``--mode launch`` (the default) starts each job with ``slipstream run --nproc 2``, as a user
does; ``--mode fork`` forks the two ranks from this process, which imported torch and
slipstream once (the ranks still exit as a script does: atexit hooks, interpreter
finalization, C++ static destructors), about 10x less CPU per cycle on a loaded machine.

``--busy N`` starts N busy-loop processes beside the job for the whole soak (the load that
made the abort likelier); ``--cores`` lets the ranks write core dumps (``ulimit -c``) into
each failing cycle's directory under ``--keep`` (read one with ``gdb python core`` and
``thread apply all bt``); a rank still running at ``--timeout`` (fork mode) has every
thread's state (/proc), Python stacks (faulthandler, into its log) and native stacks (gdb)
saved first. The summary prints the counts per variant, the seconds per cycle
and the load average before and after.
"""

from __future__ import annotations

import argparse
import collections
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_SCRIPT = """
import atexit, faulthandler, os, signal, sys, time, torch
import slipstream

faulthandler.register(signal.SIGUSR1, all_threads=True)  # the soak asks a hung rank for stacks
# Registered first, so it runs last of the exit hooks (and the one below first).
atexit.register(lambda: print(f"exit hooks done at {time.time():.3f}", flush=True))
from slipstream.models import GPT, GPTConfig

directory, variant, cycle = sys.argv[-3], sys.argv[-2], int(sys.argv[-1])
torch.manual_seed(0)
config = {
    "train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "checkpoint": {"async_save": variant == "async"},
}
engine = slipstream.initialize(model=GPT(GPTConfig.preset("tiny", dropout=0.0)), config=config)[0]
ckpt = os.path.join(directory, "ckpt")
if os.path.exists(os.path.join(ckpt, "latest")):
    engine.load_checkpoint(ckpt)
for step in range(2):
    g = torch.Generator().manual_seed(cycle * 2 + step)
    x = torch.randint(0, 256, (4, 17), generator=g)
    engine.backward(engine(x[:, :-1], x[:, 1:]))
    engine.step()
engine.save_checkpoint(ckpt, tag=f"tag{cycle % 2}")
engine.destroy()
atexit.register(lambda: print(f"exit hooks start at {time.time():.3f}", flush=True))
"""


def _allow_cores() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _run_rank(code: object, work: Path, rank: int, port: str, argv: list[str], cores: bool) -> None:
    """In a forked rank: the environment ``slipstream run`` would give, output to a file,
    the script, then ``sys.exit`` (atexit hooks, finalization and C++ teardown run as
    after any script). Never returns."""
    status = 1
    try:
        if cores:
            _allow_cores()
        os.chdir(work)
        log = os.open(work / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                          LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)  # fmt: skip
        sys.argv = argv
        exec(code, {"__name__": "__main__"})  # the soak's own script
        status = 0
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.exit(status)  # unwinds through the driver's frames: they check _OWNER


def _fork_cycle(
    script: Path, work: Path, variant: str, cycle: int, timeout_s: float, cores: bool
) -> tuple[int | None, str]:
    """Fork the two ranks of one cycle; the exit code is the first nonzero one."""
    code = compile(script.read_text(), str(script), "exec")
    port = str(_free_port())
    argv = [str(script), str(work), variant, str(cycle)]
    pids = []
    for rank in range(2):
        pid = os.fork()
        if pid == 0:
            _run_rank(code, work, rank, port, argv, cores)
        pids.append(pid)
    deadline = time.monotonic() + timeout_s
    codes: dict[int, int] = {}
    ended: dict[int, float] = {}
    while len(codes) < len(pids):
        for pid in pids:
            if pid not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done == pid:
                    codes[pid] = os.waitstatus_to_exitcode(status)
                    ended[pid] = time.time()
        if time.monotonic() > deadline:
            notes = [f"[soak] rank {pids.index(p)} (pid {p}) ended at {ended[p]:.3f}, code {codes[p]}"
                     for p in pids if p in codes]  # fmt: skip
            for pid in set(pids) - set(codes):
                notes.append(
                    f"[soak] rank {pids.index(pid)} (pid {pid}) alive at {time.time():.3f}"
                )
                _dump_stacks(pid, work / f"stacks-{pid}.txt")
                os.kill(pid, signal.SIGKILL)
                codes[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            return None, _logs(work) + "\n".join(notes) + "\n"
        time.sleep(0.05)
    bad = [c for c in (codes[p] for p in pids) if c != 0]
    # As a shell reports a signal: 128 + its number (SIGABRT: 134).
    first = (128 - bad[0] if bad[0] < 0 else bad[0]) if bad else 0
    return first, _logs(work)


def _proc_threads(pid: int) -> str:
    """Each thread's name, state, kernel wait channel, current system call and (as root)
    kernel stack from /proc: cheap and without ptrace, so it works when gdb cannot attach in
    time on a loaded machine."""
    lines = []
    for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
        fields = []
        for name in ("comm", "wchan", "syscall", "stack"):
            try:
                fields.append(Path(f"/proc/{pid}/task/{tid}/{name}").read_text().strip())
            except OSError as err:
                fields.append(f"({name}: {err.strerror})")
        try:
            state = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            state = "?"
        kernel = " <- ".join(f.split()[-1] for f in fields[3].splitlines()[:6])
        lines.append(
            f"thread {tid} {fields[0]!r} state {state} wchan {fields[1]} syscall {fields[2]}"
            f" kernel {kernel}"
        )
    return "\n".join(lines) + "\n"


def _run_tool(cmd: list[str], timeout_s: float) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        return done.stdout + done.stderr
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"{cmd[0]} failed: {err}\n"


def _dump_stacks(pid: int, out: Path) -> None:
    """Every thread of a hung rank before it is killed: /proc's view of each thread, then its
    native and Python stacks (py-spy, when installed: seconds), then gdb's (when installed;
    600 s, since attaching takes minutes under load), then Python's from the rank itself."""
    try:
        text = _proc_threads(pid)
    except OSError as err:
        text = f"/proc/{pid}: {err}\n"
    out.write_text(text)
    spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if spy is not None:
        text += "--- py-spy dump --native\n" + _run_tool(
            [spy, "dump", "--native", "--pid", str(pid)], 300
        )
        out.write_text(text)
    gdb = shutil.which("gdb")
    if gdb is not None:
        cmd = [gdb, "-batch", "-p", str(pid), "-ex", "thread apply all bt 30"]
        text += "--- gdb\n" + _run_tool(cmd, 600)
        out.write_text(text)
    # Last, Python's stacks into the rank's log (faulthandler, registered by the script):
    # after interpreter finalization SIGUSR1 ends the process instead.
    try:
        os.kill(pid, signal.SIGUSR1)
        time.sleep(3)
    except ProcessLookupError:
        pass


def _logs(work: Path) -> str:
    return "".join(f"[rank{r}] {t}\n" for r in range(2)
                   for t in (work / f"rank{r}.log").read_text().splitlines())  # fmt: skip


def _cycle(
    script: Path, work: Path, variant: str, cycle: int, timeout_s: float, cores: bool
) -> tuple[int | None, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env["SLIPSTREAM_LOG_LEVEL"] = "WARNING"
    cmd = [sys.executable, "-m", "slipstream.cli.main", "run", "--nproc", "2", str(script),
           str(work), variant, str(cycle)]  # fmt: skip
    proc = subprocess.Popen(
        cmd,
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=_allow_cores if cores else None,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        proc.kill()  # the workers die with the launcher (parent-death signal)
        out, _ = proc.communicate()
        return None, out


def soak(args: argparse.Namespace) -> int:
    keep = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="soak-exit-"))
    keep.mkdir(parents=True, exist_ok=True)
    work = keep / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    script = keep / "cycle.py"
    script.write_text(textwrap.dedent(_SCRIPT))
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    owner = os.getpid()
    busy = []
    for _ in range(args.busy):
        busy.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
    codes: dict[str, collections.Counter[str]] = {v: collections.Counter() for v in variants}
    failures: list[str] = []
    run = _fork_cycle if args.mode == "fork" else _cycle
    if args.mode == "fork":  # import once here; the forked ranks inherit it
        os.environ["OMP_NUM_THREADS"] = "1"  # as the launched ranks get (read at import)
        os.environ["SLIPSTREAM_LOG_LEVEL"] = "WARNING"
        import slipstream.checkpoint  # noqa: F401
        from slipstream.models import GPT, GPTConfig

        GPT(GPTConfig.preset("tiny"))  # imports what building on meta needs (torch._dynamo)
    load_before = os.getloadavg()
    start = time.monotonic()
    try:
        for cycle in range(args.cycles):
            if args.minutes and time.monotonic() - start > args.minutes * 60:
                break
            variant = variants[cycle % len(variants)]
            code, out = run(script, work, variant, cycle, args.timeout, args.cores)
            codes[variant][str(code)] += 1
            if code != 0:
                where = keep / f"failed-{cycle:04d}"
                where.mkdir(exist_ok=True)
                (where / "output.txt").write_text(out)
                for kept in [*work.glob("core*"), *work.glob("stacks-*.txt")]:
                    kept.rename(where / kept.name)
                tail = " | ".join(out.strip().splitlines()[-3:])
                failures.append(f"cycle {cycle} ({variant}): exit {code}: {tail[-300:]}")
                print(failures[-1], flush=True)
            if args.progress and (cycle + 1) % args.progress == 0:
                print(f"{cycle + 1}/{args.cycles} cycles, {len(failures)} not exit 0, "
                      f"load {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
    finally:
        for p in busy if os.getpid() == owner else []:  # not in a forked rank's sys.exit
            p.kill()
            p.wait()
    seconds = time.monotonic() - start
    done = sum(sum(c.values()) for c in codes.values())
    aborts = sum(c["134"] for c in codes.values())
    print(f"mode {args.mode}: {done} cycles in {seconds:.0f} s ({seconds / max(done, 1):.1f} s per cycle), "
          f"{args.busy} busy-loop processes beside them")  # fmt: skip
    for variant, counter in codes.items():
        print(f"  {variant:<6} exit codes: {dict(sorted(counter.items()))}")
    print(f"aborts (exit 134): {aborts}; not exit 0: {len(failures)}")
    print(f"load average (1, 5, 15 min) before {load_before}, after {os.getloadavg()}")
    print(f"outputs of failed cycles: {keep}" if failures else f"scratch: {keep}")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=300)
    parser.add_argument("--variants", default="sync,async", help="sync, async or both")
    parser.add_argument("--mode", choices=["launch", "fork"], default="launch")
    parser.add_argument("--busy", type=int, default=0, help="busy-loop processes beside the job")
    parser.add_argument("--minutes", type=float, default=0, help="stop after this long")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per cycle")
    parser.add_argument("--cores", action="store_true", help="let the ranks dump core")
    parser.add_argument("--keep", default=None, help="directory for outputs (default: a temp)")
    parser.add_argument("--progress", type=int, default=25, help="print every N cycles")
    return soak(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
