"""Run a function on N gloo ranks in fresh processes and collect each rank's return value.

The ranks are forked from a ``forkserver`` that imported torch and slipstream once, not
spawned: a spawned rank spends 1.5-3 s of this 2-core machine importing them before it does
any work, and the suite starts a few hundred ranks. The server imports modules only (no
threads, no process group), so every rank still starts from a fresh interpreter state: its
environment is the caller's at the time of the call (passed explicitly, as a fork server
would otherwise hand out its own), its process group and RNG are its own. A forked process
leaves through ``os._exit``, which skips ``atexit``; the ranks run the exit handlers their own
code registered when ``fn`` returns, as an interpreter that exits would (what is flushed at
exit is tested that way), and apply ``SLIPSTREAM_AS_DEEPSPEED`` as an interpreter that starts
would.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


FORKSERVER_PRELOAD = [
    "torch",
    "torch.distributed",
    # Imported lazily by torch's optimizers, checkpointing and the mesh (about 800 modules,
    # 2-3 s): once in the server instead of once per rank.
    "torch._dynamo",
    "torch.distributed.device_mesh",
    "slipstream",
    "slipstream.models",
    "slipstream.pipe",
    "slipstream.checkpoint",
    "slipstream.quant",
    "slipstream.recsys",
    "slipstream.science",
    "slipstream.vision",
    "numba",
    "tests.docs._blocks",
]
"""What the one fork server of the test session imports before it forks anything (this
harness and the documentation blocks share it: it starts once, with the first of them)."""
multiprocessing.get_context("forkserver").set_forkserver_preload(FORKSERVER_PRELOAD)


def _entry(
    rank: int,
    fn: Callable[..., Any],
    world: int,
    port: int,
    outdir: str,
    args: tuple[Any, ...],
    environ: dict[str, str],
) -> None:
    atexit._clear()  # the server's handlers are not this rank's
    os.environ.clear()
    os.environ.update(environ)
    # What slipstream_as_deepspeed.pth does at interpreter start, for this environment.
    import _slipstream_as_deepspeed as alias

    alias.uninstall()
    alias.install_from_env()
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        SLIPSTREAM_COMM_TIMEOUT="120",
    )
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        try:
            result = fn(*args)
            torch.save(result, Path(outdir) / f"rank{rank}.pt")
        finally:
            dist.destroy_process_group()
    finally:
        atexit._run_exitfuncs()


def run_world(
    fn: Callable[..., Any], world: int, *args: Any, timeout_s: float | None = None
) -> list[Any]:
    """Spawn ``world`` processes running ``fn(*args)`` under gloo; return per-rank results.

    ``fn`` must be importable (a module-level function of a test module). A world still
    running after ``timeout_s`` (default ``SLIPSTREAM_TEST_WORLD_TIMEOUT`` or 600 s) is
    killed and the test fails with a ``TimeoutError``: a hang never blocks the suite.
    """
    if timeout_s is None:
        timeout_s = float(os.environ.get("SLIPSTREAM_TEST_WORLD_TIMEOUT", "600"))
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(
            _entry,
            args=(fn, world, _free_port(), outdir, args, dict(os.environ)),
            nprocs=world,
            join=False,
            start_method="forkserver",
        )
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                for p in ctx.processes:
                    p.kill()
                    p.join()
                raise TimeoutError(
                    f"{fn.__qualname__} on {world} ranks did not finish within {timeout_s:.0f} s "
                    "(killed; SLIPSTREAM_TEST_WORLD_TIMEOUT sets the limit)"
                )
        return [torch.load(Path(outdir) / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _fresh_entry(
    fn: Callable[..., Any], args: tuple[Any, ...], environ: dict[str, str], cwd: str, outdir: str
) -> None:
    """Entry of :func:`run_fresh`'s process: what a new interpreter running ``fn`` would do."""
    out, err = (os.open(Path(outdir) / n, os.O_WRONLY | os.O_CREAT, 0o644) for n in ("o", "e"))
    os.dup2(out, 1)  # children (a launcher's ranks) inherit these too
    os.dup2(err, 2)
    atexit._clear()
    os.environ.clear()
    os.environ.update(environ)
    import _slipstream_as_deepspeed as alias

    alias.uninstall()
    alias.install_from_env()
    os.chdir(cwd)
    if "OMP_NUM_THREADS" in environ:  # what torch reads when it starts in a new interpreter
        torch.set_num_threads(int(environ["OMP_NUM_THREADS"]))
    code = 0
    try:
        result = fn(*args)
        torch.save(result, Path(outdir) / "result.pt")
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
        code = code or 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def start_fresh(
    fn: Callable[..., Any],
    *args: Any,
    outdir: str,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
) -> multiprocessing.process.BaseProcess:
    """Start what :func:`run_fresh` runs and return the process at once (its stdout, stderr and
    return value go to files ``o``, ``e`` and ``result.pt`` in ``outdir``)."""
    environ = dict(os.environ if env is None else env)
    ctx = multiprocessing.get_context("forkserver")
    proc = ctx.Process(  # type: ignore[attr-defined]
        target=_fresh_entry, args=(fn, args, environ, str(cwd or os.getcwd()), outdir)
    )
    proc.start()
    return proc


def run_fresh(
    fn: Callable[..., Any],
    *args: Any,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    timeout_s: float = 120,
) -> subprocess.CompletedProcess[str]:
    """Run ``fn(*args)`` in one process forked from the harness's fork server, as a fresh
    ``python`` would run it: no process group, the environment ``env`` (default: this one),
    its own exit handlers run at the end, stdout/stderr captured (processes it starts write
    there too). Costs a fork instead of the seconds a new interpreter spends importing torch
    and slipstream.

    Returns a ``CompletedProcess`` whose ``returncode`` is 0, ``fn``'s ``SystemExit`` code,
    or 1 (an exception: its traceback ends ``stderr``), with ``fn``'s return value as
    ``.result``. A process still running after ``timeout_s`` is killed (its launched ranks die
    with it) and ``subprocess.TimeoutExpired`` is raised, as ``subprocess.run`` does.
    """
    with tempfile.TemporaryDirectory() as outdir:
        proc = start_fresh(fn, *args, env=env, cwd=cwd, outdir=outdir)
        proc.join(timeout_s)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
            out, err = ((Path(outdir) / n).read_bytes() for n in ("o", "e"))
            raise subprocess.TimeoutExpired(fn.__qualname__, timeout_s, out, err)
        result = Path(outdir) / "result.pt"
        done = subprocess.CompletedProcess(
            [fn.__qualname__, *map(str, args)],
            proc.exitcode,
            (Path(outdir) / "o").read_text(errors="replace"),
            (Path(outdir) / "e").read_text(errors="replace"),
        )
        done.result = torch.load(result, weights_only=False) if result.exists() else None  # type: ignore[attr-defined]
    return done


def cli_main(argv: list[str]) -> int:
    """`slipstream ARGV` in this process: the function run_cli forks."""
    from slipstream.cli.main import main

    return main(argv)


def run_cli(
    argv: Sequence[str],
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    timeout_s: float = 120,
) -> subprocess.CompletedProcess[str]:
    """``python -m slipstream.cli.main ARGV`` (exit status, stdout, stderr), forked warm by
    :func:`run_fresh` instead of a new interpreter. A job it launches starts its ranks as the
    command does (fresh interpreters through the launcher)."""
    done = run_fresh(cli_main, list(argv), env=env, cwd=cwd, timeout_s=timeout_s)
    if done.returncode == 0 and isinstance(done.result, int):  # type: ignore[attr-defined]
        done.returncode = done.result  # type: ignore[attr-defined]
    return done


def _script_main(target: str, args: list[str], module: bool) -> None:
    sys.argv = [target, *args]
    if module:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, str(Path(target).resolve().parent))
        runpy.run_path(target, run_name="__main__")


def run_script(
    target: str | Path,
    *args: str,
    module: bool = False,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    timeout_s: float = 120,
) -> subprocess.CompletedProcess[str]:
    """``python TARGET ARGS`` (``python -m TARGET ARGS`` with ``module=True``) as ``__main__``,
    forked warm by :func:`run_fresh`: exit status, stdout and stderr as ``subprocess.run``
    gives them, without the seconds of importing torch and slipstream again."""
    return run_fresh(_script_main, str(target), list(args), module, env=env, cwd=cwd,
                     timeout_s=timeout_s)  # fmt: skip


def _exec_code(code: str) -> None:
    sys.argv = ["-c"]
    exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})


def run_code(
    code: str,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    timeout_s: float = 120,
) -> subprocess.CompletedProcess[str]:
    """``python -c CODE``, forked warm by :func:`run_fresh` (``SLIPSTREAM_AS_DEEPSPEED`` in
    ``env`` applies as at interpreter start). Not for what only a new interpreter shows (the
    ``.pth`` hook itself, what ``import slipstream`` imports): start one for those."""
    return run_fresh(_exec_code, code, env=env, cwd=cwd, timeout_s=timeout_s)
