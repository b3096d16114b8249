"""DeepSpeed's own unit tests, run on real DeepSpeed and on slipstream under the switch.

Usage::

    python benchmarks/deepspeed_unit_tests.py SOURCE [--side both|deepspeed|slipstream]
        [--files SUBSTR,...] [--timeout S] [--json out.json] [--keep DIR]

``SOURCE`` is a DeepSpeed source checkout (a directory holding ``tests/unit``) or a bare git
repository of DeepSpeed (its ``tests/`` is extracted with ``git archive``). DeepSpeed's PyPI
sdist does not ship ``tests/`` (its ``MANIFEST.in`` leaves them out), so a checkout is
needed; nothing of DeepSpeed's test code is kept in this repository. The tests are read from
a fresh copy in a temporary directory.

The chosen tests are listed in ``TESTS`` below: DeepSpeed ``tests/unit`` node ids that pass on
DeepSpeed 0.19.8 (the installed release) on a CPU, measured with the 0.19.6 source's tests.
Each side runs them as DeepSpeed's CPU CI does: ``pytest --forked`` (pytest-forked, from
PyPI) from DeepSpeed's ``tests/`` directory, its ``pytest.ini`` and ``conftest.py`` in force,
with ``DS_ACCELERATOR=cpu`` and ``LOCAL_SIZE=2`` (the CPU accelerator then reports two
devices, so tests of one and two ranks run and those of four skip), ``OMP_NUM_THREADS=1``.

- ``deepspeed``: the installed DeepSpeed (``SLIPSTREAM_AS_DEEPSPEED`` unset).
- ``slipstream``: the same tests with ``SLIPSTREAM_AS_DEEPSPEED=1``, so every ``deepspeed``
  import in them is slipstream.

It prints, by file, how many of the chosen tests passed on each side, then the totals and
slipstream's pass rate over the tests that passed on DeepSpeed in this run, and the
slipstream failures with their first error line. docs/compatibility.md lists the tests that
fail on purpose and why.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

# DeepSpeed tests/unit node ids, by file (relative to tests/unit). Every one passed on
# DeepSpeed 0.19.8 on this project's CPU machine with the settings above.
TESTS: dict[str, list[str]] = {}

SIDES = ("deepspeed", "slipstream")

# pytest-forked 1.7.5 sends each report from the forked child with marshal, and pytest 9's
# reports carry a NodeId object (``_id``) that marshal refuses, so every forked test "exits
# with status 3". This plugin, loaded with ``-p``, hands the id over as the ``nodeid`` string
# the report's constructor takes, and any other unmarshallable value as its str.
_FORKED_FIX = """\
import marshal

import pytest_forked

_serialize = pytest_forked.serialize_report


def serialize_report(rep):
    d = _serialize(rep)
    if "_id" in d and "nodeid" not in d:
        d["nodeid"] = str(d.pop("_id"))
    for key, value in list(d.items()):
        try:
            marshal.dumps(value)
        except ValueError:
            d[key] = str(value)
    return d


pytest_forked.serialize_report = serialize_report
"""


@dataclass
class Outcome:
    """One test's result on one side."""

    status: str  # passed, failed, error, skipped, missing
    message: str = ""


@dataclass
class SideRun:
    """All results of one side."""

    side: str
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    seconds: float = 0.0


def extract_tests(source: Path, into: Path) -> Path:
    """Copy DeepSpeed's ``tests/`` from a checkout or a bare git repository into ``into``.

    Returns:
        The ``tests`` directory of the copy.

    Raises:
        SystemExit: ``source`` is neither a checkout with ``tests/unit`` nor a git repository.
    """
    if (source / "tests" / "unit").is_dir():
        shutil.copytree(source / "tests", into / "tests", symlinks=True)
    elif (source / "HEAD").is_file() and (source / "objects").is_dir():
        archive = subprocess.run(
            ["git", f"--git-dir={source}", "archive", "HEAD", "tests"],
            check=True,
            capture_output=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    else:
        raise SystemExit(
            f"{source}: not a DeepSpeed checkout (no tests/unit) nor a bare git repository of "
            "DeepSpeed; clone https://github.com/deepspeedai/DeepSpeed and pass its path"
        )
    plugins = into / "tests" / "_plugins"
    plugins.mkdir()
    (plugins / "_forked_marshal_fix.py").write_text(_FORKED_FIX)
    return into / "tests"


def _node_id(case: ET.Element) -> str:
    """``file::Class::name`` relative to ``tests/unit`` from a junit (xunit1) test case."""
    file = case.get("file", "")
    classname = case.get("classname", "")
    name = case.get("name", "")
    module_parts = file.removesuffix(".py").replace("/", ".")
    cls = classname[len(module_parts) :].lstrip(".") if classname.startswith(module_parts) else ""
    rel = file.removeprefix("unit/")
    return "::".join(p for p in (rel, cls, name) if p)


def _read_junit(path: Path) -> dict[str, Outcome]:
    outcomes: dict[str, Outcome] = {}
    if not path.is_file():
        return outcomes
    for case in ET.parse(path).getroot().iter("testcase"):
        status, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            child = case.find(tag)
            if child is not None:
                status = {"failure": "failed"}.get(tag, tag)
                text = (child.text or child.get("message") or "").strip()
                errors = [ln[1:].strip() for ln in text.splitlines() if ln.startswith("E ")]
                message = (errors or text.splitlines() or [""])[-1][:200]
                break
        node = _node_id(case)
        # A setup error and a call failure of one test both land here; keep the worst.
        if outcomes.get(node, Outcome("passed")).status == "passed":
            outcomes[node] = Outcome(status, message)
    return outcomes


_VERDICT = re.compile(r"^unit/(\S.*?) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b")


def _read_log(path: Path) -> dict[str, Outcome]:
    """Verdicts from pytest's verbose lines, for a run stopped before it wrote its junit file."""
    outcomes: dict[str, Outcome] = {}
    ansi = re.compile(r"\x1b\[[0-9;]*m")
    for line in ansi.sub("", path.read_text(errors="replace")).splitlines():
        match = _VERDICT.match(line)
        if match:
            status = {"PASSED": "passed", "FAILED": "failed", "SKIPPED": "skipped"}
            outcomes[match[1]] = Outcome(status.get(match[2], "error"))
    return outcomes


def run_side(
    side: str,
    tests_dir: Path,
    ids: Sequence[str],
    timeout: float,
    time_limit: float | None = None,
) -> SideRun:
    """Run ``ids`` (relative to ``tests/unit``) with pytest --forked on one side, stopping
    after ``time_limit`` seconds (the tests not reached count as missing)."""
    import time

    env = dict(os.environ)
    env.pop("SLIPSTREAM_AS_DEEPSPEED", None)
    env.update(
        DS_ACCELERATOR="cpu",
        LOCAL_SIZE="2",
        OMP_NUM_THREADS="1",
        DS_UNITTEST_TIMEOUT=str(int(timeout)),
        PYTHONDONTWRITEBYTECODE="1",
        HF_HUB_OFFLINE="1",
        # DeepSpeed JIT-builds its CPU ops (fused_adam, shm comm) on first use; a cache of
        # our own keeps those builds apart from other users of ~/.cache/torch_extensions.
        TORCH_EXTENSIONS_DIR=str(Path.home() / ".cache" / "slipstream" / "ds_unit_extensions"),
        PYTHONPATH=os.pathsep.join(
            p for p in (str(tests_dir / "_plugins"), env.get("PYTHONPATH", "")) if p
        ),
    )
    if side == "slipstream":
        env["SLIPSTREAM_AS_DEEPSPEED"] = "1"
    junit = tests_dir / f"junit-{side}.xml"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "--forked",
        "-p",
        "_forked_marshal_fix",
        "-p",
        "no:cacheprovider",
        # A file that fails to import fails its own tests, not the whole run.
        "--continue-on-collection-errors",
        "-q",
        "-o",
        "junit_family=xunit1",
        f"--junitxml={junit}",
        *(f"unit/{i}" for i in ids),
    ]
    start = time.perf_counter()
    log = tests_dir / f"pytest-{side}.log"
    # Stopped by the time limit: the tests reached so far are read from the log.
    with log.open("w") as out, contextlib.suppress(subprocess.TimeoutExpired):
        subprocess.run(
            cmd, cwd=tests_dir, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=time_limit
        )
    run = SideRun(side, seconds=time.perf_counter() - start)
    found = _read_junit(junit) or _read_log(log)
    for node in ids:
        run.outcomes[node] = found.get(node, Outcome("missing", "not collected (import error?)"))
    if any(o.status == "missing" for o in run.outcomes.values()):
        _explain_missing(run, log)
    return run


def _explain_missing(run: SideRun, log: Path) -> None:
    """Attach the collection error of a test's file to the tests pytest never reached."""
    text = log.read_text(errors="replace")
    for node, outcome in run.outcomes.items():
        if outcome.status != "missing":
            continue
        file = node.split("::")[0]
        marker = f"ERROR collecting unit/{file}"
        at = text.find(marker)
        if at >= 0:
            tail = [ln for ln in text[at:].splitlines()[1:40] if ln.startswith("E   ")]
            if tail:
                outcome.message = tail[-1][4:].strip()[:200]


def report(runs: dict[str, SideRun], ids: Sequence[str]) -> dict[str, object]:
    """Print the by-file table and the totals; return them as a dict."""
    by_file: dict[str, list[str]] = {}
    for node in ids:
        by_file.setdefault(node.split("::")[0], []).append(node)
    sides = [s for s in SIDES if s in runs]
    header = f"{'file':58s} {'tests':>5s} " + " ".join(f"{s:>10s}" for s in sides)
    print(header)
    print("-" * len(header))
    rows = {}
    for file, nodes in by_file.items():
        counts = {s: sum(runs[s].outcomes[n].status == "passed" for n in nodes) for s in sides}
        rows[file] = {"tests": len(nodes), **counts}
        print(f"{file:58s} {len(nodes):5d} " + " ".join(f"{counts[s]:10d}" for s in sides))
    totals = {s: sum(o.status == "passed" for o in runs[s].outcomes.values()) for s in sides}
    print("-" * len(header))
    print(
        f"{'total (' + str(len(by_file)) + ' files)':58s} {len(ids):5d} "
        + " ".join(f"{totals[s]:10d}" for s in sides)
    )
    summary: dict[str, object] = {"files": rows, "totals": totals, "tests": len(ids)}
    for s in sides:
        print(f"{s}: {runs[s].seconds:.0f} s")
    if "slipstream" in runs:
        base = (
            [n for n in ids if runs["deepspeed"].outcomes[n].status == "passed"]
            if "deepspeed" in runs
            else list(ids)
        )
        ok = sum(runs["slipstream"].outcomes[n].status == "passed" for n in base)
        rate = ok / len(base) if base else 0.0
        what = "passed on DeepSpeed in this run" if "deepspeed" in runs else "chosen"
        print(f"slipstream passes {ok}/{len(base)} of the tests {what}: {rate:.1%}")
        summary["slipstream_rate"] = rate
        failing = [n for n in base if runs["slipstream"].outcomes[n].status != "passed"]
        if failing:
            print("\nnot passing on slipstream:")
            for n in failing:
                o = runs["slipstream"].outcomes[n]
                print(f"  {n}\n      {o.status}: {o.message}")
    if "deepspeed" in runs:
        broken = [n for n in ids if runs["deepspeed"].outcomes[n].status != "passed"]
        if broken:
            print("\nnot passing on DeepSpeed here (the list assumes they do):")
            for n in broken:
                o = runs["deepspeed"].outcomes[n]
                print(f"  {n}\n      {o.status}: {o.message}")
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="DeepSpeed checkout or bare git repository")
    parser.add_argument("--side", choices=("both", *SIDES), default="both")
    parser.add_argument("--files", default="", help="only files containing one of these (comma)")
    parser.add_argument("--ids", nargs="*", default=None, help="run these node ids instead")
    parser.add_argument("--ids-file", type=Path, default=None, help="node ids, one a line")
    parser.add_argument("--timeout", type=float, default=300, help="DS_UNITTEST_TIMEOUT (s)")
    parser.add_argument(
        "--time-limit", type=float, default=None, help="stop each side after this many seconds"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the summary here")
    parser.add_argument("--keep", type=Path, default=None, help="work here and keep the logs")
    args = parser.parse_args(argv)

    try:
        import pytest_forked  # noqa: F401
    except ImportError:
        raise SystemExit("pytest --forked needs pytest-forked: pip install pytest-forked") from None

    if args.ids_file is not None:
        ids = [ln.strip() for ln in args.ids_file.read_text().splitlines() if ln.strip()]
    elif args.ids is not None:
        ids = list(args.ids)
    else:
        wanted = [w for w in args.files.split(",") if w]
        ids = [
            i
            for f, nodes in TESTS.items()
            if not wanted or any(w in f for w in wanted)
            for i in nodes
        ]
    work = args.keep or Path(tempfile.mkdtemp(prefix="ds_unit_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        tests_dir = extract_tests(args.source.resolve(), work)
        sides = SIDES if args.side == "both" else (args.side,)
        runs = {s: run_side(s, tests_dir, ids, args.timeout, args.time_limit) for s in sides}
        summary = report(runs, ids)
        summary["outcomes"] = {
            s: {n: [o.status, o.message] for n, o in r.outcomes.items()} for s, r in runs.items()
        }
        if args.json:
            args.json.write_text(json.dumps(summary, indent=1))
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
