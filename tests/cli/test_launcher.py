"""Tests for `slipstream run`: hostfile/filters, ssh command construction, real local launches."""

from __future__ import annotations

import json
import os
import shlex
import socket
import time
from pathlib import Path

import pytest

from slipstream.cli._hostfile import (
    LaunchError,
    filter_resources,
    parse_hostfile,
    parse_hostfile_text,
    select_resources,
)
from slipstream.cli._multinode import (
    NodeCommand,
    NodeLaunchSpec,
    build_node_commands,
    collect_exports,
    decode_world_info,
    run_parallel,
)
from slipstream.cli.main import main
from tests.distributed.harness import run_cli

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).parent / "_scripts"
WRITE_ENV = str(SCRIPTS / "write_env.py")
FAIL_RANK1 = str(SCRIPTS / "fail_rank1.py")
PY = "/usr/bin/python3"


def slipstream(*args: str, env: dict[str, str] | None = None, timeout: float = 90):
    """`python -m slipstream.cli.main ARGS` from the repo root, forked warm (``run_cli``: the
    launcher does not spend seconds importing torch again; its ranks start as they always do)."""
    full_env = {**os.environ, **(env or {})}
    full_env.pop("OMP_NUM_THREADS", None)
    return run_cli(args, env=full_env, cwd=REPO, timeout_s=timeout)


def read_ranks(out_dir: Path) -> dict[int, dict]:
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in out_dir.glob("rank*.json")}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# --- hostfile -------------------------------------------------------------------------------


def test_hostfile_parses_hosts_in_order_with_comments_and_blank_lines():
    text = "# cluster\n\nworker-1 slots=2  # two GPUs\nworker-0   slots=4\n"
    assert parse_hostfile_text(text, "hf") == {"worker-1": [0, 1], "worker-0": [0, 1, 2, 3]}


def test_hostfile_bad_line_error_names_file_line_number_and_line(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text("worker-0 slots=2\n# ok\nworker-1 slots=two\n")
    with pytest.raises(LaunchError) as err:
        parse_hostfile(path)
    assert str(err.value) == (
        f"hostfile {path}, line 3: 'worker-1 slots=two': expected 'hostname slots=N' "
        "(e.g. 'worker-0 slots=8')"
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a slots=0\n", "hostfile hf, line 1: 'a slots=0': slots must be at least 1"),
        ("a slots=1\na slots=2\n", "host 'a' is listed twice"),
        ("# only a comment\n", "hostfile hf lists no hosts"),
    ],
)
def test_hostfile_rejects_zero_slots_duplicates_and_empty(text, message):
    with pytest.raises(LaunchError, match=message):
        parse_hostfile_text(text, "hf")


def test_missing_hostfile_is_a_clear_error(tmp_path):
    with pytest.raises(LaunchError, match=r"cannot read hostfile .*nope"):
        parse_hostfile(tmp_path / "nope")


# --- include / exclude / num_nodes / nproc ------------------------------------------------

POOL = {"w0": [0, 1, 2, 3], "w1": [0, 1, 2, 3], "w2": [0, 1]}


def test_include_keeps_listed_hosts_and_slots_in_hostfile_order():
    assert filter_resources(POOL, include="w2@w0:1,3") == {"w0": [1, 3], "w2": [0, 1]}


def test_exclude_drops_whole_hosts_or_single_slots():
    assert filter_resources(POOL, exclude="w1@w0:0,2") == {"w0": [1, 3], "w2": [0, 1]}


@pytest.mark.parametrize(
    ("include", "exclude", "message"),
    [
        ("w0", "w1", "--include and --exclude are mutually exclusive"),
        ("w9:0", None, "--include: unknown host 'w9'; known hosts: w0, w1, w2"),
        ("w2:5", None, r"--include: host 'w2' has no slot 5 \(its slots: \[0, 1\]\)"),
        ("w0:a", None, "slots of 'w0' must be comma-separated integers, got 'a'"),
        (None, "w0@w1@w2", "leaves no slots to run on"),
    ],
)
def test_filter_errors(include, exclude, message):
    with pytest.raises(LaunchError, match=message):
        filter_resources(POOL, include=include, exclude=exclude)


def test_num_nodes_takes_first_hosts_and_nproc_first_slots():
    assert select_resources(POOL, num_nodes=2, nproc=2) == {"w0": [0, 1], "w1": [0, 1]}
    assert select_resources(POOL, exclude="w0:0", nproc=1) == {"w0": [1], "w1": [0], "w2": [0]}


def test_num_nodes_and_nproc_limits_are_checked():
    with pytest.raises(LaunchError, match="--num_nodes 4: must be between 1 and the 3"):
        select_resources(POOL, num_nodes=4)
    with pytest.raises(LaunchError, match="host 'w2' has only 2 slot"):
        select_resources(POOL, nproc=3)


# --- multi-node command construction (pure) ----------------------------------------------


def test_ssh_commands_per_host_with_rank_nproc_devices_env_and_port():
    spec = NodeLaunchSpec(
        script="train.py",
        script_args=["--lr", "1e-3", "a b"],
        master_port=29501,
        flags=["--no_local_rank"],
        ssh_port=2222,
        launcher_args=["-o", "StrictHostKeyChecking=no"],
        set_visible_devices=True,
    )
    cmds = build_node_commands(
        {"w0": [0, 2], "w1": [1]},
        spec,
        cwd="/data/my run",
        exports={"NCCL_DEBUG": "INFO", "PYTHONPATH": "/x y"},
        python="/venv/bin/python",
    )
    assert [c.host for c in cmds] == ["w0", "w1"]
    ssh = ["ssh", "-o", "BatchMode=yes", "-p", "2222", "-o", "StrictHostKeyChecking=no"]
    assert cmds[0].argv[:-1] == [*ssh, "w0"]
    assert cmds[0].argv[-1] == (
        "cd '/data/my run' && env NCCL_DEBUG=INFO PYTHONPATH='/x y' CUDA_VISIBLE_DEVICES=0,2 "
        "/venv/bin/python -u -m slipstream.cli.main run --no_ssh --num_nodes 2 --node_rank 0 "
        "--nproc 2 --stop_on_stdin_eof --master_addr w0 --master_port 29501 --no_local_rank "
        "train.py --lr 1e-3 'a b'"
    )
    remote1 = shlex.split(cmds[1].argv[-1])
    assert "CUDA_VISIBLE_DEVICES=1" in remote1
    assert remote1[remote1.index("--node_rank") + 1] == "1"
    assert remote1[remote1.index("--nproc") + 1] == "1"
    assert remote1[remote1.index("--master_addr") + 1] == "w0"


def test_pdsh_command_is_one_call_with_world_info_and_pdsh_rank():
    spec = NodeLaunchSpec(script="train.py", launcher="pdsh", master_addr="10.0.0.1", ssh_port=22)
    (cmd,) = build_node_commands(
        {"w0": [0, 1], "w1": [0]}, spec, cwd="/run", exports={}, python="python"
    )
    assert cmd.argv[:6] == ["pdsh", "-S", "-f", "1024", "-w", "w0,w1"]
    assert cmd.env == {"PDSH_RCMD_TYPE": "ssh", "PDSH_SSH_ARGS_APPEND": "-p 22"}
    remote = shlex.split(cmd.argv[-1])
    assert remote[remote.index("--node_rank") + 1] == "%n"
    info = remote[remote.index("--world_info") + 1]
    assert decode_world_info(info) == [("w0", [0, 1]), ("w1", [0])]


def test_exports_take_prefixed_env_and_env_files_later_overriding(tmp_path):
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    (home / ".deepspeed_env").write_text("A=home\nB=home\n")
    (cwd / ".deepspeed_env").write_text("# comment\nB=cwd-ds\n\n")
    (cwd / ".slipstream_env").write_text("C=x=y\n")
    environ = {"NCCL_IB_DISABLE": "1", "PYTHONPATH": "/p", "HOME": "/h", "UCX_TLS": "tcp"}
    exports = collect_exports(environ, [home, cwd])
    assert exports == {
        "NCCL_IB_DISABLE": "1",
        "PYTHONPATH": "/p",
        "UCX_TLS": "tcp",
        "A": "home",
        "B": "cwd-ds",
        "C": "x=y",
    }
    (cwd / ".slipstream_env").write_text("not a pair\n")
    with pytest.raises(LaunchError, match=r"\.slipstream_env, line 1: 'not a pair': expected"):
        collect_exports({}, [cwd])


def test_run_parallel_fails_fast_with_first_exit_code_and_prefixes_output(capfd):
    cmds = [
        NodeCommand("a", ["sh", "-c", "echo hello; sleep 0.3; exit 3"]),
        NodeCommand("b", ["sh", "-c", "exec sleep 60"]),
    ]
    start = time.monotonic()
    assert run_parallel(cmds) == 3
    assert time.monotonic() - start < 15
    out, err = capfd.readouterr()
    assert "[a] hello" in out
    assert "slipstream run: node a failed (exit code 3;" in err


# --- argument errors: one line on stderr, exit code 2 -------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nproc", "0", WRITE_ENV], "--nproc 0: must be at least 1"),
        (["missing_script.py"], "script not found: missing_script.py"),
        (["--module", "--no_python", "x"], "--module and --no_python cannot be combined"),
        (["--no_ssh", "--num_nodes", "2", WRITE_ENV], "needs --master_addr"),
    ],
)
def test_bad_requests_exit_2_with_one_line(args, message, capsys):
    assert main(["run", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("slipstream run: error: ") and message in err
    assert err.count("\n") == 1


def test_bad_hostfile_and_filters_exit_2(tmp_path, capsys):
    hostfile = tmp_path / "hf"
    hostfile.write_text("w0 slots=2\nw1 slots=2\n")
    assert main(["run", "-H", str(hostfile), "-i", "w0", "-e", "w1", WRITE_ENV]) == 2
    assert "mutually exclusive" in capsys.readouterr().err
    assert main(["run", "-H", str(hostfile), "-i", "w5", WRITE_ENV]) == 2
    assert "unknown host 'w5'" in capsys.readouterr().err
    hostfile.write_text("w0 slots=2\nw1 {line}\n")
    result = slipstream("run", "-H", str(hostfile), WRITE_ENV)
    assert result.returncode == 2
    assert result.stderr == (
        f"slipstream run: error: hostfile {hostfile}, line 2: 'w1 {{line}}': "
        "expected 'hostname slots=N' (e.g. 'worker-0 slots=8')\n"
    )


def test_demo_subcommand_without_its_module_explains(monkeypatch, capsys):
    import slipstream.cli.main as cli_main

    def missing(name):
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    monkeypatch.setattr(cli_main.importlib, "import_module", missing)
    assert main(["demo"]) == 2
    assert "no demo module (slipstream.cli.demo)" in capsys.readouterr().err


# --- real launches (each spawns torch's elastic agent and two ranks) ----------------------


def test_two_ranks_get_env_and_local_rank_first_in_argv(tmp_path):
    result = slipstream("run", "--nproc", "2", WRITE_ENV, str(tmp_path), "--extra", "x y")
    assert result.returncode == 0, result.stderr
    ranks = read_ranks(tmp_path)
    assert sorted(ranks) == [0, 1]
    for rank, facts in ranks.items():
        assert facts["name"] == "__main__"
        assert facts["env"]["RANK"] == facts["env"]["LOCAL_RANK"] == str(rank)
        assert facts["env"]["WORLD_SIZE"] == facts["env"]["LOCAL_SIZE"] == "2"
        assert facts["argv"] == [WRITE_ENV, f"--local_rank={rank}", str(tmp_path), "--extra", "x y"]
        assert facts["local_rank_arg"] == rank
        assert facts["sys_path0"] == str(SCRIPTS)
        cpus = len(os.sched_getaffinity(0))
        assert facts["env"]["OMP_NUM_THREADS"] == str(max(1, cpus // 2))
    assert "OMP_NUM_THREADS not set; using" in result.stderr


def test_module_mode_and_no_local_rank(tmp_path):
    module = "tests.cli._scripts.write_env"
    result = slipstream("run", "--nproc", "1", "--no_local_rank", "--module", module, str(tmp_path))
    assert result.returncode == 0, result.stderr
    facts = read_ranks(tmp_path)[0]
    assert facts["name"] == "__main__"
    assert facts["argv"][1:] == [str(tmp_path)]
    assert facts["local_rank_arg"] is None


def test_include_on_local_hostfile_sets_cuda_visible_devices(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=4\n")
    out = tmp_path / "out"
    out.mkdir()
    result = slipstream("run", "-H", str(hostfile), "-i", "localhost:1,3", WRITE_ENV, str(out))
    assert result.returncode == 0, result.stderr
    ranks = read_ranks(out)
    assert sorted(ranks) == [0, 1]
    assert {f["env"]["CUDA_VISIBLE_DEVICES"] for f in ranks.values()} == {"1,3"}


def test_failing_rank_exit_code_is_returned_and_other_ranks_stopped(tmp_path):
    start = time.monotonic()
    result = slipstream("run", "--nproc", "2", FAIL_RANK1, str(tmp_path), "exit", timeout=60)
    assert time.monotonic() - start < 45
    assert result.returncode == 7, result.stderr
    assert "slipstream run: rank 1 (local rank 1, pid " in result.stderr
    assert "failed with exit code 7; no Python traceback recorded" in result.stderr
    assert not pid_alive(int((tmp_path / "rank0.pid").read_text()))


def test_raising_rank_points_at_its_traceback(tmp_path):
    result = slipstream("run", "--nproc", "2", FAIL_RANK1, str(tmp_path), "raise", timeout=60)
    assert result.returncode == 1
    line = next(ln for ln in result.stderr.splitlines() if ln.startswith("slipstream run: rank"))
    assert "rank 1 (local rank 1" in line
    assert "failed with exit code 1; ValueError: rank 1 broke on purpose; traceback in " in line
    error_file = line.split("traceback in ")[1].split(";")[0]
    data = json.loads(Path(error_file).read_text())
    assert "rank 1 broke on purpose" in data["message"]["extraInfo"]["py_callstack"]


# --- multi-node through a fake `ssh` that runs the remote command locally ------------------


@pytest.fixture
def fake_ssh(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    ssh = bin_dir / "ssh"
    ssh.write_text('#!/bin/sh\nfor last; do :; done\nexec sh -c "$last"\n')
    ssh.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLIPSTREAM_TEST_MARK": "m"}


@pytest.mark.slow
def test_two_nodes_over_ssh_ranks_exports_and_failure_exit_code(tmp_path, fake_ssh):
    """Both nodes start with global ranks and the exported env; rank 1 (node-b) exits 7, so
    `slipstream run` returns 7 and node-a's rank is stopped."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    port = str(free_port())
    args = ["-H", str(hostfile), "--master_addr", "127.0.0.1", "--master_port", port]
    result = slipstream("run", *args, FAIL_RANK1, str(tmp_path), "exit", env=fake_ssh)
    assert result.returncode == 7, result.stdout + result.stderr
    ranks = read_ranks(tmp_path)
    assert sorted(ranks) == [0, 1]
    for rank, facts in ranks.items():
        env = facts["env"]
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == (str(rank), "0", "2")
        assert (env["CROSS_RANK"], env["CROSS_SIZE"]) == (str(rank), "2")
        assert (env["MASTER_PORT"], env["SLIPSTREAM_TEST_MARK"]) == (port, "m")
        assert facts["local_rank_arg"] == 0
    assert "[node-b] slipstream run: rank 1 (local rank 0" in result.stdout
    assert "slipstream run: node node-b failed (exit code 7;" in result.stderr
    rank0 = int((tmp_path / "rank0.pid").read_text())
    deadline = time.monotonic() + 15
    while pid_alive(rank0) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(rank0)
