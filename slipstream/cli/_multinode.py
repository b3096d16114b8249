"""Multi-node fan-out: one ``slipstream run --no_ssh`` per host, over ssh (default) or pdsh.

Each node runs our own launcher in per-node mode (torchrun's static rendezvous underneath)
rather than bare ``python -m torch.distributed.run``: torchrun's CLI exits with 1 whatever the
failing rank returned, while ``slipstream run`` exits with the failing rank's code, which ssh
then carries back. Command construction is pure (:func:`build_node_commands`) so it is tested
without ssh; :func:`run_parallel` runs the commands, prefixes output with the host, stops the
others as soon as one fails and returns the first failure's exit code.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from slipstream.cli._hostfile import LaunchError, ResourceMap

__all__ = [
    "EXPORT_PREFIXES",
    "NodeCommand",
    "NodeLaunchSpec",
    "build_node_commands",
    "collect_exports",
    "decode_world_info",
    "run_parallel",
]

EXPORT_PREFIXES = ("NCCL", "PYTHON", "MLFLOW", "UCX", "MV2", "SLIPSTREAM")
_ENV_FILES = (".deepspeed_env", ".slipstream_env")  # later files override earlier ones
_SSH_FAILURE = 255


@dataclass(frozen=True)
class NodeLaunchSpec:
    """What every node runs and how to reach it (everything but the per-host part)."""

    script: str
    """User script path (or module name with ``module``, executable with ``no_python``)."""
    script_args: list[str] = field(default_factory=list)
    master_addr: str = ""
    """Rendezvous host (node 0 hosts the store); default: the first host of the map."""
    master_port: int = 29500
    flags: list[str] = field(default_factory=list)
    """Per-node launcher flags forwarded as-is (``--module``, ``--no_local_rank``, ...)."""
    launcher: str = "ssh"
    """``ssh`` (one client per host, fail-fast) or ``pdsh`` (one ``pdsh -S`` for all)."""
    launcher_args: list[str] = field(default_factory=list)
    ssh_port: int | None = None
    set_visible_devices: bool = False
    """Export ``CUDA_VISIBLE_DEVICES`` = the host's slots (``--include/--exclude`` given)."""


@dataclass(frozen=True)
class NodeCommand:
    """One process to start locally: ``argv`` reaching ``host`` (``"*"`` for pdsh)."""

    host: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    """Extra variables for the local process (pdsh reads its options from the environment)."""


def _read_env_file(path: Path) -> dict[str, str]:
    exports: dict[str, str] = {}
    for lineno, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip().isidentifier():
            raise LaunchError(f"{path}, line {lineno}: {raw.strip()!r}: expected KEY=VALUE")
        exports[key.strip()] = value
    return exports


def collect_exports(environ: Mapping[str, str], dirs: list[Path]) -> dict[str, str]:
    """Environment to carry to every node: variables of ``environ`` whose name starts with
    one of :data:`EXPORT_PREFIXES`, then the ``KEY=VALUE`` lines of ``.deepspeed_env`` and
    ``.slipstream_env`` found in ``dirs`` (later dirs and files override earlier ones).
    ``SLIPSTREAM_ENV_FILE`` / ``DS_ENV_FILE`` rename the file looked for."""
    exports = {k: v for k, v in environ.items() if k.startswith(EXPORT_PREFIXES)}
    names = [
        environ.get("DS_ENV_FILE", _ENV_FILES[0]),
        environ.get("SLIPSTREAM_ENV_FILE", _ENV_FILES[1]),
    ]
    for directory in dirs:
        for name in names:
            path = directory / name
            if path.is_file():
                exports.update(_read_env_file(path))
    return exports


def _encode_world_info(resources: ResourceMap) -> str:
    raw = json.dumps(list(resources.items())).encode()
    return base64.urlsafe_b64encode(raw).decode()


def decode_world_info(text: str) -> list[tuple[str, list[int]]]:
    """Inverse of the ``--world_info`` encoding used for pdsh: ``[(host, slots), ...]``."""
    try:
        return [
            (str(h), [int(s) for s in slots])
            for h, slots in json.loads(base64.urlsafe_b64decode(text))
        ]
    except ValueError as err:
        raise LaunchError(f"--world_info: cannot decode {text!r}: {err}") from None


def _remote_command(
    spec: NodeLaunchSpec, cwd: str, python: str, env: Mapping[str, str], node_args: list[str]
) -> str:
    """The shell line one node runs: cd, env, then ``slipstream run --no_ssh`` for that node."""
    env_part = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    argv = [python, "-u", "-m", "slipstream.cli.main", "run", "--no_ssh", *node_args]
    argv += ["--master_addr", spec.master_addr, "--master_port", str(spec.master_port)]
    argv += [*spec.flags, spec.script, *spec.script_args]
    # "%n" (pdsh's node rank) must reach pdsh unquoted; shlex.quote leaves it bare anyway.
    cmd = " ".join(shlex.quote(a) for a in argv)
    return f"cd {shlex.quote(cwd)} && " + (f"env {env_part} {cmd}" if env_part else cmd)


def build_node_commands(
    resources: ResourceMap,
    spec: NodeLaunchSpec,
    *,
    cwd: str,
    exports: Mapping[str, str],
    python: str = sys.executable,
) -> list[NodeCommand]:
    """Local commands that start ``spec`` on every host of ``resources`` (pure function).

    Node ``i`` (hostfile order) gets ``--node_rank i`` and ``--nproc len(slots)``; with ssh
    there is one command per host (its launcher stops when the ssh connection closes), with pdsh a single ``pdsh -S`` whose node rank is pdsh's
    ``%n`` and whose per-host slots travel in ``--world_info``.
    """
    num_nodes = len(resources)
    master = spec.master_addr or next(iter(resources))
    spec = NodeLaunchSpec(**{**spec.__dict__, "master_addr": master})
    if spec.launcher == "pdsh":
        node_args = ["--num_nodes", str(num_nodes), "--node_rank", "%n"]
        node_args += ["--world_info", _encode_world_info(resources)]
        if spec.set_visible_devices:
            node_args.append("--set_visible_devices")
        remote = _remote_command(spec, cwd, python, exports, node_args)
        argv = ["pdsh", "-S", "-f", "1024", "-w", ",".join(resources), *spec.launcher_args, remote]
        local_env = {"PDSH_RCMD_TYPE": "ssh"}
        if spec.ssh_port is not None:
            local_env["PDSH_SSH_ARGS_APPEND"] = f"-p {spec.ssh_port}"
        return [NodeCommand("*", argv, local_env)]
    if spec.launcher != "ssh":
        raise LaunchError(f"--launcher {spec.launcher!r}: supported launchers are ssh and pdsh")
    commands = []
    for node_rank, (host, slots) in enumerate(resources.items()):
        env = dict(exports)
        if spec.set_visible_devices:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, slots))
        node_args = ["--num_nodes", str(num_nodes), "--node_rank", str(node_rank)]
        node_args += ["--nproc", str(len(slots)), "--stop_on_stdin_eof"]
        remote = _remote_command(spec, cwd, python, env, node_args)
        port = ["-p", str(spec.ssh_port)] if spec.ssh_port is not None else []
        # BatchMode: fail at once instead of waiting at a password prompt nobody sees.
        argv = ["ssh", "-o", "BatchMode=yes", *port, *spec.launcher_args, host, remote]
        commands.append(NodeCommand(host, argv))
    return commands


def _pump(proc: subprocess.Popen[str], prefix: str) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(prefix + line)
        sys.stdout.flush()


def _stop(procs: list[subprocess.Popen[str]], grace_s: float = 10.0) -> None:
    for proc in procs:
        if proc.poll() is None:
            # Killing an ssh client does not signal the remote command (no pty); closing its
            # stdin does: the remote `--stop_on_stdin_eof` launcher sees EOF and stops its ranks.
            _close_stdin(proc)
            proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _close_stdin(proc: subprocess.Popen[str]) -> None:
    if proc.stdin is not None:
        with contextlib.suppress(OSError):
            proc.stdin.close()


def run_parallel(commands: list[NodeCommand]) -> int:
    """Start ``commands`` together; return 0 when all succeed, else the exit code of the first
    that failed, after stopping the others. Output lines are prefixed with ``[host]``."""
    procs = []
    threads = []
    for cmd in commands:
        proc = subprocess.Popen(
            cmd.argv,
            stdin=subprocess.PIPE,  # never written; closing it stops the remote side
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **cmd.env},
        )
        prefix = "" if cmd.host == "*" else f"[{cmd.host}] "
        thread = threading.Thread(target=_pump, args=(proc, prefix), daemon=True)
        thread.start()
        procs.append(proc)
        threads.append(thread)
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                index, code = failed[0]
                _stop(procs)
                _report_node_failure(commands[index].host, code)
                return code if code > 0 else 128 - code
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.1)
    except KeyboardInterrupt:
        _stop(procs)
        return 130
    finally:
        for proc in procs:
            _close_stdin(proc)
        for thread in threads:
            thread.join(timeout=1.0)


def _report_node_failure(host: str, code: int) -> None:
    if code == _SSH_FAILURE:
        why = "exit code 255: ssh could not connect or authenticate (check passwordless ssh)"
    else:
        why = f"exit code {code}; its failing rank is named in the [{host}] lines above"
    where = "pdsh" if host == "*" else f"node {host}"
    print(f"slipstream run: {where} failed ({why}); stopped the other nodes", file=sys.stderr)
