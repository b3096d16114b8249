"""Fault matrix: inject each checkpoint fault into real processes and report what a user gets.

Usage::

    python benchmarks/faults.py                       # every case (about 50 worlds)
    python benchmarks/faults.py --list                # case names
    python benchmarks/faults.py --cases 'reuse-kill-2renames:commit.moved_old,empty-latest'
    python benchmarks/faults.py --cases 'save-kill*' --json faults.json
    FAULTS_EXIT_REPEATS=10 python benchmarks/faults.py --cases exit-codes

Each case is one world of fresh processes (``--world`` 1 or 2 ranks, gloo on 127.0.0.1, a
tiny GPT at ZeRO-1, or ZeRO-3 where a rank-local failure must get past collectives) that
runs a short script of operations (train, save, damage a file, load); the fault is armed
just before the operation under test. Faults are ``kill`` (SIGKILL of the process at a named
point between two filesystem steps: nothing runs after it), ``raise`` (an ``OSError``
ENOSPC at a point, on one rank), a real write limit (``RLIMIT_FSIZE``: the kernel refuses
the write, as a full disk does) or damage done to the files between a save and a load.

Per case the table shows:

- **s to error**: seconds from the start of the faulty call to the last rank's exception
  (slowest rank); ``-`` where nothing should raise (a killed save). A hang shows as a
  timeout.
- **data lost**: whether a checkpoint committed before the fault can no longer be loaded
  (checked by the same lookup a load does, which also recovers an interrupted tag reuse, and
  a full check of every file against the manifest), or a damaged one was loaded anyway.
- **outcome**: the first line of the error, or which checkpoint ``latest`` now loads.

The kill families (``save-kill``, ``reuse-kill``, ``reuse-kill-2renames``) first record the
fault points a save passes (one world), then kill one world per point; name one point as
``<family>:<point>``. Other scenarios (launcher, NaN steps) register with ``register``.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

__all__ = [
    "CASES",
    "CaseResult",
    "FaultCase",
    "World",
    "format_table",
    "inspect_latest",
    "main",
    "register",
    "run_cases",
    "run_world",
]

_FAULT = "SLIPSTREAM_CHECKPOINT_FAULT"
_ARMED = "FAULTS_BENCH_FAULT"  # moved to _FAULT by the "fault" operation


# --------------------------------------------------------------------------- results


@dataclass
class CaseResult:
    """One row of the matrix."""

    case: str
    seconds: float | None
    """Start of the faulty call to the slowest rank's exception; None: no error expected."""
    data_lost: bool
    outcome: str
    """First line of the error, or what loads now."""
    ok: bool
    """Whether this is the behaviour wanted (a clean error on every rank, nothing lost)."""
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class FaultCase:
    """A named fault scenario: ``run(scratch_dir, timeout_s, point)`` returns its rows
    (``point``: one member of a family, from ``--cases <family>:<point>``; else None)."""

    name: str
    description: str
    run: Callable[[Path, float, str | None], list[CaseResult]]


CASES: dict[str, FaultCase] = {}


def register(case: FaultCase) -> FaultCase:
    """Add a case to the matrix (``--cases`` selects by name or glob)."""
    CASES[case.name] = case
    return case


# --------------------------------------------------------------------------- worlds


@dataclass
class World:
    """The outcome of one world: per rank, its operations' records and its exit code."""

    records: list[list[dict[str, Any]]]
    exit_codes: list[int | None]
    timed_out: bool

    def op(self, name: str) -> list[dict[str, Any] | None]:
        """Every rank's record of its last operation called ``name`` (None if not reached)."""
        found: list[dict[str, Any] | None] = []
        for recs in self.records:
            found.append(next((r for r in reversed(recs) if r["op"] == name), None))
        return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_world(
    directory: Path,
    ops: Sequence[str],
    world: int = 1,
    fault: str | None = None,
    timeout_s: float = 120.0,
    stage: int = 1,
) -> World:
    """Run ``ops`` (see ``_OPS``) on ``world`` fresh rank processes saving under
    ``directory``; ``fault`` (``SLIPSTREAM_CHECKPOINT_FAULT`` syntax) is armed by the
    ``fault`` operation. Processes still running after ``timeout_s`` are killed."""
    directory.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    procs, outs = [], []
    for rank in range(world):
        out = directory.parent / f".{directory.name}.rank{rank}.jsonl"
        out.unlink(missing_ok=True)
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            PYTHONPATH=str(ROOT),
            SLIPSTREAM_LOG_LEVEL="WARNING",
        )
        env.pop(_FAULT, None)
        if fault:
            env[_ARMED] = fault
        cmd = [sys.executable, __file__, "--worker", str(directory), str(out), str(stage), *ops]
        procs.append(
            subprocess.Popen(
                cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
        )
        outs.append(out)
    deadline = time.monotonic() + timeout_s
    timed_out = False
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    records = [
        [json.loads(line) for line in o.read_text().splitlines()] if o.exists() else []
        for o in outs
    ]
    for o in outs:
        o.unlink(missing_ok=True)
    return World(records, [p.returncode for p in procs], timed_out)


# --------------------------------------------------------------------------- rank side


def _engine(stage: int) -> tuple[Any, Any]:
    import torch
    from torch.utils.data import TensorDataset

    import slipstream
    from slipstream.models import GPT, GPTConfig

    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.manual_seed(0)
    data = TensorDataset(
        torch.randint(0, 256, (64, 17), generator=torch.Generator().manual_seed(1))
    )
    config = {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 8 // world,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "checkpoint": {"barrier_timeout": 30},
    }
    model = GPT(GPTConfig.preset("tiny", dropout=0.0))
    engine, _, loader, _ = slipstream.initialize(model=model, config=config, training_data=data)
    return engine, iter(loader)


def _damage(root: Path, what: str) -> None:
    """Rank 0 damages a file as a bad disk or a careless edit would."""
    kind, _, arg = what.partition("=")
    if kind == "corrupt":
        path = root / arg
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    elif kind == "edit-manifest":
        path = root / arg / "manifest.json"
        path.write_text(path.read_text().replace('"global_steps": 1', '"global_steps": 9', 1))
    elif kind == "garble-manifest":
        path = root / arg / "manifest.json"
        path.write_bytes(b"\xff\xfe" + path.read_bytes()[2:])
    elif kind == "latest":
        (root / "latest").write_text(arg)
    else:
        raise ValueError(f"unknown damage {what!r}")


def _worker(directory: str, out: str, stage: int, ops: list[str]) -> None:
    """Run ``ops`` in order, appending one JSON record per operation to ``out``."""
    import torch.distributed as dist

    from slipstream.checkpoint import commit

    root = Path(directory)
    engine, batches = _engine(stage)
    rank = dist.get_rank()
    log = open(out, "a")  # noqa: SIM115 - one line per op, flushed, kept open until exit
    for op in ops:
        name, _, arg = op.partition(":")
        record: dict[str, Any] = {"op": op, "error": None}
        start = time.perf_counter()
        try:
            if name == "train":
                (batch,) = next(batches)
                engine.backward(engine(batch[:, :-1], batch[:, 1:]))
                engine.step()
            elif name == "save":
                tag, _, marker = arg.partition("=")
                engine.save_checkpoint(root, tag=tag, client_state={"v": marker or tag})
            elif name == "load":
                path, client = engine.load_checkpoint(root, tag=arg or None)
                record["loaded"] = [path, client]
            elif name == "keep":
                engine.config.checkpoint.keep_last = int(arg)
            elif name == "no-exchange":
                commit.use_exchange = False
            elif name == "fault":
                os.environ[_FAULT] = os.environ.get(_ARMED, "")
            elif name == "fsize":  # a disk that refuses writes past this many bytes
                limit, _, only = arg.partition("@")
                if not only or int(only) == rank:
                    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG, not a signal
                    resource.setrlimit(resource.RLIMIT_FSIZE, (int(limit), int(limit)))
            elif name == "damage":
                if rank == 0:
                    _damage(root, arg)
                dist.barrier()
            elif name == "record":  # the fault points a save passes
                from slipstream.checkpoint import _faults

                seen: list[str] = []
                _faults.set_hook(seen.append)
                tag, _, marker = arg.partition("=")
                engine.save_checkpoint(root, tag=tag, client_state={"v": marker or tag})
                _faults.set_hook(None)
                record["points"] = seen
            elif name == "barrier":
                dist.barrier()
            else:
                raise ValueError(f"unknown operation {op!r}")
        except Exception as e:
            record["error"] = f"{type(e).__name__}: {e}"
        record["seconds"] = time.perf_counter() - start
        log.write(json.dumps(record) + "\n")
        log.flush()
    engine.destroy()


# --------------------------------------------------------------------------- parent checks


def inspect_latest(root: Path) -> tuple[str | None, str]:
    """What the next ``load_checkpoint(root)`` gets: (``client_state["v"]`` of the
    checkpoint, how) after the same lookup (and recovery), with every file verified;
    (None, the error) when it cannot load."""
    import torch

    from slipstream.checkpoint import CheckpointError, CheckpointReader
    from slipstream.checkpoint.commit import find_checkpoint

    try:
        directory = find_checkpoint(root, None)
        if directory is None:
            return None, f"no '{root.name}/latest'"
        reader = CheckpointReader(directory)
        for name in reader.manifest["files"]:
            reader.verify(name)
        extra = torch.load(directory / "extra.pt", weights_only=False)
        return str(extra["client_state"].get("v")), f"latest loads {directory.name}"
    except CheckpointError as e:
        return None, f"CheckpointError: {e}"


def _first_line(text: str | None) -> str:
    return (text or "").strip().splitlines()[0] if text else ""


def _error_row(case: str, w: World, op: str, root: Path, keeps: str | None) -> CaseResult:
    """A case whose faulty ``op`` must raise on every rank that was not killed.

    ``keeps``: the marker ``latest`` must still load afterwards; None for damage cases,
    where the damaged checkpoint must be refused (data is lost if it loads anyway).
    """
    recs = w.op(op)
    alive = [code != -signal.SIGKILL for code in w.exit_codes]
    errors = [r["error"] if r else None for r in recs]
    everyone = all(e for e, a in zip(errors, alive) if a) and not w.timed_out
    seconds = max(r["seconds"] for r, a in zip(recs, alive) if r and a) if everyone else None
    if keeps is None:
        lost, how = not everyone, "damaged checkpoint refused" if everyone else "loaded"
    else:
        marker, how = inspect_latest(root)
        lost = marker != keeps
    message = _first_line(next((e for e in errors if e), None)).replace(str(root), "<dir>") or (
        "TIMEOUT (a rank hung)" if w.timed_out else f"no error on ranks {errors}"
    )
    return CaseResult(case, seconds, lost, message, everyone and not lost, {"after": how})


# --------------------------------------------------------------------------- cases


def _kill_family(name: str, setup: list[str], faulty: str, desc: str) -> None:
    """One world per fault point of ``faulty`` (a save), killed there; then ``latest``
    must load the checkpoint from before (``old``) or the new one."""

    def one(directory: Path, point: str, timeout_s: float) -> CaseResult:
        w = run_world(directory, [*setup, "fault", faulty], fault=f"kill:{point}",
                      timeout_s=timeout_s)  # fmt: skip
        marker, how = inspect_latest(directory)
        killed = w.exit_codes[0] == -signal.SIGKILL
        lost = marker not in ("old", "new")
        outcome = f"killed; {how} ({marker})" if killed else f"not killed (exit {w.exit_codes})"
        return CaseResult(f"{name}:{point}", None, lost, outcome, killed and not lost)

    def run(scratch: Path, timeout_s: float, point: str | None) -> list[CaseResult]:
        if point is not None:
            return [one(scratch / "w", point, timeout_s)]
        w = run_world(scratch / "rec", [*setup, faulty.replace("save", "record", 1)],
                      timeout_s=timeout_s)  # fmt: skip
        rec = w.op(faulty.replace("save", "record", 1))[0]
        if not rec or rec["error"]:
            return [CaseResult(name, None, False, f"recording failed: {rec}", False)]
        rows = []
        for i, p in enumerate(rec["points"]):
            rows.append(one(scratch / f"p{i}", p, timeout_s))
        return rows

    register(FaultCase(name, desc, run))


_kill_family(
    "save-kill",
    ["keep:2", "train", "save:first=first", "train", "save:A=old", "train"],
    "save:B=new",
    "kill a save of a new tag (keep_last 2 deletes 'first') after each filesystem step",
)
_kill_family(
    "reuse-kill",
    ["train", "save:first=first", "train", "save:A=old", "train", "keep:1"],
    "save:A=new",
    "kill a save reusing tag A (RENAME_EXCHANGE) after each filesystem step",
)
_kill_family(
    "reuse-kill-2renames",
    ["no-exchange", "train", "save:first=first", "train", "save:A=old", "train", "keep:1"],
    "save:A=new",
    "the same without RENAME_EXCHANGE (two renames through .A.old-X)",
)


def _simple(name: str, desc: str, ops: list[str], op: str, keeps: str | None, **kw: Any) -> None:
    """A one-world case: ``ops`` with the fault armed inside; ``op`` must raise everywhere."""

    def run(scratch: Path, timeout_s: float, point: str | None) -> list[CaseResult]:
        if point is not None:
            raise SystemExit(f"fault case {name!r} has no points")
        w = run_world(scratch / "w", ops, timeout_s=timeout_s, **kw)
        return [_error_row(name, w, op, scratch / "w", keeps)]

    register(FaultCase(name, desc, run))


_simple(
    "rank0-manifest-enospc",
    "2 ranks: ENOSPC on rank 0 only while committing the manifest; the script catches it",
    ["train", "save:A=old", "train", "fault", "save:B=new", "barrier"],
    "save:B=new",
    "old",
    world=2,
    fault="raise:manifest.written@0",
)
_simple(
    "rank1-full-disk",
    "2 ranks: rank 1's writes are refused past 64 KiB (RLIMIT_FSIZE, EFBIG) during a save",
    ["train", "save:A=old", "train", "fsize:65536@1", "save:B=new", "barrier"],
    "save:B=new",
    "old",
    world=2,
)
_simple(
    "rank1-killed-mid-save",
    "2 ranks: rank 1 is SIGKILLed after writing its shard; rank 0 must not hang",
    ["train", "save:A=old", "train", "fault", "save:B=new"],
    "save:B=new",
    "old",
    world=2,
    fault="kill:wrote.rank-00001.safetensors@1",
)
_simple(
    "corrupted-shard-rank1",
    "2 ranks: a byte flipped in rank-00001.pt, which only rank 1 reads",
    ["train", "save:A=old", "damage:corrupt=A/rank-00001.pt", "load:A"],
    "load:A",
    None,
    world=2,
)
_simple(
    "rank1-restore-error",
    "2 ranks at ZeRO-3: an I/O error on rank 1 only while restoring (after verification)",
    ["train", "save:A=old", "fault", "load:A"],
    "load:A",
    "old",
    world=2,
    stage=3,
    fault="raise:load.restored@1",
)
_simple(
    "edited-manifest",
    "a value in A/manifest.json changed by hand",
    ["train", "save:A=old", "damage:edit-manifest=A", "load:A"],
    "load:A",
    None,
)
_simple(
    "damaged-manifest",
    "A/manifest.json begins with bytes that are not UTF-8",
    ["train", "save:A=old", "damage:garble-manifest=A", "load:A"],
    "load:A",
    None,
)
_simple(
    "empty-latest",
    "an empty 'latest' file",
    ["train", "save:A=old", "damage:latest=", "load"],
    "load",
    None,
)
_simple(
    "latest-names-missing-tag",
    "'latest' names a tag that does not exist",
    ["train", "save:A=old", "damage:latest=gone", "load"],
    "load",
    None,
)


# --------------------------------------------------------------------------- runtime rows

# The launcher, killed and stalled ranks, NaN losses, config types, released ZeRO-3
# parameters and exit codes (benchmarks/_faults_runtime.py).
from benchmarks._faults_runtime import register_runtime  # noqa: E402

register_runtime(
    register, FaultCase, CaseResult, repeats=int(os.environ.get("FAULTS_EXIT_REPEATS", "50"))
)


# --------------------------------------------------------------------------- driver


def run_cases(
    names: Sequence[str], timeout_s: float = 120.0, base_dir: str | None = None
) -> list[CaseResult]:
    """Run the cases matching ``names`` (names, globs or ``<family>:<point>``) in order."""
    rows: list[CaseResult] = []
    for pattern in names:
        family, _, point = pattern.partition(":")
        matched = [c for n, c in CASES.items() if fnmatch.fnmatchcase(n, family)]
        if not matched:
            raise SystemExit(f"no fault case matches {pattern!r}: see --list")
        for case in matched:
            scratch = Path(tempfile.mkdtemp(prefix=f"fault-{case.name}-", dir=base_dir))
            try:
                rows += case.run(scratch, timeout_s, point or None)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
    return rows


def format_table(rows: Sequence[CaseResult]) -> str:
    width = max([len(r.case) for r in rows] + [4])
    header = f"{'case':<{width}} {'s to error':>10} {'data lost':>9}  outcome"
    lines = [header, "-" * len(header)]
    for r in rows:
        seconds = "-" if r.seconds is None else f"{r.seconds:.2f}"
        flag = "" if r.ok else "  << NOT OK"
        outcome = r.outcome if len(r.outcome) <= 160 else r.outcome[:157] + "..."
        lines.append(
            f"{r.case:<{width}} {seconds:>10} {'yes' if r.data_lost else 'no':>9}  {outcome}{flag}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        directory, out, stage, *ops = argv[1:]
        _worker(directory, out, int(stage), ops)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="*", help="comma-separated names or globs")
    parser.add_argument("--list", action="store_true", help="print the cases and exit")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per world")
    parser.add_argument("--dir", default=None, help="parent of the scratch directories")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = parser.parse_args(argv)
    if args.list:
        for case in CASES.values():
            print(f"{case.name:<26} {case.description}")
        return 0
    start = time.perf_counter()
    rows = run_cases(
        [c.strip() for c in args.cases.split(",") if c.strip()], args.timeout, args.dir
    )
    print(format_table(rows))
    print(f"{len(rows)} cases in {time.perf_counter() - start:.0f} s; "
          f"{sum(not r.ok for r in rows)} not OK")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return 1 if any(not r.ok for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
