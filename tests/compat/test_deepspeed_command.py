"""The `deepspeed` command under SLIPSTREAM_AS_DEEPSPEED=1: DeepSpeed's console script
(`from deepspeed.launcher.runner import main; main()`) launches 2 ranks through `slipstream
run`; DeepSpeed's flags map onto slipstream's, and those with nothing to act on are refused."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from slipstream.launcher import runner
from tests.distributed.harness import run_code

REPO = Path(__file__).resolve().parents[2]
PROBE = str(Path(__file__).parent / "_scripts" / "probe_rank.py")
CONSOLE_SCRIPT = "from deepspeed.launcher.runner import main\nmain()\n"  # DeepSpeed's bin
_BESIDE = Path(sys.executable).with_name("deepspeed")  # a DeepSpeed install in this venv
DEEPSPEED_BIN = str(_BESIDE) if _BESIDE.is_file() else shutil.which("deepspeed")


def _env() -> dict[str, str]:
    return {**os.environ, "SLIPSTREAM_AS_DEEPSPEED": "1", "OMP_NUM_THREADS": "1"}


def _ranks(out: Path) -> dict[int, dict]:
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}


def test_console_script_launches_two_ranks_on_slipstream(tmp_path: Path) -> None:
    """`deepspeed --num_gpus 2 --master_port P script args`: 2 ranks, each importing
    slipstream as `deepspeed`, with --local_rank appended as DeepSpeed does."""
    cmd = [sys.executable, "-c", CONSOLE_SCRIPT, "--num_gpus", "2", PROBE, str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = _ranks(tmp_path)
    assert sorted(ranks) == [0, 1]
    for r, rec in ranks.items():
        assert rec["deepspeed"] == "slipstream"
        assert rec["argv"][0] == f"--local_rank={r}"


@pytest.mark.skipif(DEEPSPEED_BIN is None, reason="no `deepspeed` console script installed")
def test_installed_deepspeed_command_runs_slipstream(tmp_path: Path) -> None:
    """The `deepspeed` script a DeepSpeed install put on PATH, unchanged, under the switch."""
    assert DEEPSPEED_BIN is not None
    cmd = [DEEPSPEED_BIN, "--num_gpus=2", "--no_local_rank", PROBE, str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = _ranks(tmp_path)
    assert sorted(ranks) == [0, 1]
    assert all(rec["deepspeed"] == "slipstream" for rec in ranks.values())
    assert all(rec["argv"] == [str(tmp_path)] for rec in ranks.values())


def test_a_failing_rank_is_the_commands_exit_code(tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    cmd = [sys.executable, "-c", CONSOLE_SCRIPT, "--num_gpus", "2", str(script)]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr[-3000:]


def test_deepspeed_flags_map_to_slipstream_run() -> None:
    ns = runner.parse_args(
        ["--num_gpus", "4", "--num_nodes", "2", "-H", "hosts", "--include", "a@b:0,1",
         "--master_port", "1234", "--master_addr", "n0", "--launcher", "PDSH",
         "--no_local_rank", "--module", "--enable_each_rank_log", "logs", "--no_ssh_check",
         "train", "--lr", "1"]
    )  # fmt: skip
    assert runner.run_argv(ns) == [
        "run", "--hostfile=hosts", "--include=a@b:0,1", "--num_nodes=2", "--nproc=4",
        "--master_port=1234", "--master_addr=n0", "--launcher=pdsh",
        "--enable_each_rank_log=logs", "--module", "--no_local_rank", "train", "--lr", "1",
    ]  # fmt: skip
    bare = runner.run_argv(runner.parse_args(["--num_accelerators=2", "main.py"]))
    assert bare == ["run", "--nproc=2", "main.py"]  # DeepSpeed's defaults are slipstream's


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--elastic_training"], "--elastic_training"),
        (["--autotuning", "tune"], "slipstream tune"),
        (["--save_pid"], "--save_pid"),
        (["--force_multi"], "--force_multi"),
        (["--venv_script", "v.sh"], "--venv_script v.sh"),
        (["--launcher", "openmpi"], "--launcher openmpi"),
    ],
)
def test_flags_with_nothing_to_act_on_are_refused(
    flags: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        runner.main([*flags, "main.py"])
    assert exc.value.code == 2
    assert named in capsys.readouterr().err


def test_from_deepspeed_launcher_import_runner_is_the_same_module() -> None:
    code = (
        "import deepspeed.launcher.runner as a\n"
        "from deepspeed.launcher import runner as b\n"
        "from deepspeed.launcher.runner import DEEPSPEED_ENVIRONMENT_NAME, main\n"
        "assert a is b and callable(main), (a, b)\n"
        "print(a.__name__, DEEPSPEED_ENVIRONMENT_NAME)\n"
    )
    proc = run_code(code, env=_env(), timeout_s=60)  # forked warm, the alias applied
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["slipstream.launcher.runner", ".deepspeed_env"]
