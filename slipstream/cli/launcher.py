"""``slipstream run``: the DeepSpeed-compatible launcher, on torchrun's elastic agent.

One node: ``elastic_launch`` (torchrun's API) starts ``--nproc`` workers, each running
``slipstream/cli/_rank_entry.py``, which adds ``--local_rank=N`` to the user script's argv.
Many nodes (a hostfile with remote hosts): :mod:`slipstream.cli._multinode` starts
``slipstream run --no_ssh --node_rank i`` on every host over ssh or pdsh.

Exit codes: 0 on success; the failing rank's exit code when a rank fails (128+N when it was
killed by signal N); 2 for a bad request (hostfile, filters, missing script), printed as one
line without a traceback.
"""

from __future__ import annotations

import argparse
import glob
import logging
import math
import os
import shlex
import shutil
import signal
import socket
import sys
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slipstream.cli._binding import BIND_CORES_ENV, plan_core_binding
from slipstream.cli._failures import (
    classify_failures,
    format_report,
    job_exit_status,
    track_worker_stops,
)
from slipstream.cli._hostfile import (
    LaunchError,
    ResourceMap,
    is_local_host,
    parse_hostfile,
    select_resources,
)
from slipstream.cli._multinode import (
    NodeLaunchSpec,
    build_node_commands,
    collect_exports,
    decode_world_info,
    run_parallel,
)
from slipstream.cli._rank_entry import LAUNCHER_PID_ENV
from slipstream.distributed._timeout_env import COMM_TIMEOUT_ENV, DEFAULT_COMM_TIMEOUT_S

__all__ = [
    "AS_DEEPSPEED_ENV",
    "DEFAULT_HOSTFILE",
    "LocalPlan",
    "add_parser",
    "launch_local",
    "run_command",
]

DEFAULT_HOSTFILE = "/job/hostfile"
AS_DEEPSPEED_ENV = "SLIPSTREAM_AS_DEEPSPEED"  # read by _slipstream_as_deepspeed at startup
DEFAULT_MASTER_PORT = 29500
DEEPSPEED_ENVIRONMENT_NAME = ".deepspeed_env"
"""DeepSpeed's file of KEY=VALUE lines exported on every node (``slipstream run`` reads it
too); Accelerate imports the name as ``deepspeed.launcher.runner.DEEPSPEED_ENVIRONMENT_NAME``."""
_STATIC_RUN_ID = "slipstream"  # static rendezvous: every node must use the same id
_RANK_ENTRY = str(Path(__file__).with_name("_rank_entry.py"))  # by path: see its docstring

_EPILOG = f"""\
When a rank fails, the others are stopped and the rank that failed first is named, with its
exit code (also the launcher's) and traceback; ranks that failed only because a peer died
(connection reset or closed by peer) are listed after it as secondary. Workers die with the
launcher, even when it is killed by SIGKILL (Linux).

A collective that waits longer than {COMM_TIMEOUT_ENV} seconds (default
{DEFAULT_COMM_TIMEOUT_S:.0f}; --comm_timeout sets it) fails with an error naming the
collective, its axis and the ranks that did not arrive: a stalled rank (stopped, deadlocked)
ends the job instead of hanging it. Raise it when one rank legitimately works alone for
longer (e.g. rank-0-only data preparation before a barrier).
"""


def add_parser(subparsers: Any) -> None:
    """Register ``run`` on the ``slipstream`` subcommand parser."""
    p = subparsers.add_parser(
        "run",
        help="launch a training script on one or many nodes (DeepSpeed launcher flags)",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog=_EPILOG,
        allow_abbrev=False,
    )
    res = p.add_argument_group("where to run")
    res.add_argument("--nproc", "--nproc_per_node", "--num_gpus", dest="nproc", type=int,
                     help="processes per node (default: visible CUDA GPUs, else 1); with a "
                     "hostfile, the first N slots of each host")  # fmt: skip
    res.add_argument("-H", "--hostfile", default=None,
                     help=f"'hostname slots=N' per line (default: {DEFAULT_HOSTFILE} if it "
                     "exists, else this machine only)")  # fmt: skip
    res.add_argument("-i", "--include", help="hosts/slots to use, e.g. 'worker-0@worker-1:0,2'")
    res.add_argument("-e", "--exclude", help="hosts/slots to skip, same syntax as --include")
    res.add_argument("--num_nodes", type=int, help="use the first K hosts (with --no_ssh: K nodes)")
    res.add_argument("--node_rank", type=int, default=0, help="this node's rank (--no_ssh)")
    res.add_argument("--master_addr", default="",
                     help="rendezvous host (default: first host; one node: localhost)")  # fmt: skip
    res.add_argument("--master_port", type=int, default=None,
                     help=f"rendezvous port (default {DEFAULT_MASTER_PORT}; one node without it: "
                     "a free port)")  # fmt: skip
    how = p.add_argument_group("how to start")
    how.add_argument("--no_local_rank", action="store_true",
                     help="do not append --local_rank=N to the script's arguments")  # fmt: skip
    how.add_argument("--module", action="store_true", help="run SCRIPT as a module (python -m)")
    how.add_argument("--no_python", action="store_true",
                     help="SCRIPT is an executable, run without python")  # fmt: skip
    how.add_argument("--no_ssh", action="store_true",
                     help="run only this node's ranks (use on each node with --node_rank, "
                     "--num_nodes, --master_addr)")  # fmt: skip
    how.add_argument("--launcher", choices=("ssh", "pdsh"), default="ssh",
                     help="multi-node fan-out (default ssh: fail-fast, exact exit codes)")  # fmt: skip
    how.add_argument("--launcher_args", default="",
                     help="extra options for ssh/pdsh, one quoted string")  # fmt: skip
    how.add_argument("--ssh_port", type=int, default=None, help="ssh port on the remote hosts")
    how.add_argument("--enable_each_rank_log", metavar="DIR", default=None,
                     help="also write each rank's stdout/stderr under DIR")  # fmt: skip
    how.add_argument("--bind_cores_to_rank", action="store_true",
                     help="pin each local rank to an equal share of the cores (physical cores, "
                     "or --bind_core_list) and set OMP_NUM_THREADS to that share")  # fmt: skip
    how.add_argument("--bind_core_list", default=None, metavar="LIST",
                     help="cores to share out with --bind_cores_to_rank, e.g. '0-3,8-11'")  # fmt: skip
    how.add_argument("--as-deepspeed", "--as_deepspeed", dest="as_deepspeed",
                     action="store_true",
                     help="set SLIPSTREAM_AS_DEEPSPEED=1 for every rank: `import deepspeed` is "
                     "slipstream there (docs/compatibility.md)")  # fmt: skip
    how.add_argument("--comm_timeout", metavar="SECONDS", type=float, default=None,
                     help=f"fail a collective that waits longer than this (sets "
                     f"{COMM_TIMEOUT_ENV} for every rank; default "
                     f"{DEFAULT_COMM_TIMEOUT_S:.0f} s)")  # fmt: skip
    # Internal: how the multi-node fan-out tells a node its slots (pdsh has one command for all).
    how.add_argument("--world_info", default=None, help=argparse.SUPPRESS)
    how.add_argument("--set_visible_devices", action="store_true", help=argparse.SUPPRESS)
    how.add_argument("--stop_on_stdin_eof", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("script", help="training script (module with --module)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(handler=run_command)


@dataclass(frozen=True)
class LocalPlan:
    """The ranks to start on this machine: one torchrun elastic agent."""

    nproc: int
    entrypoint: str
    """Program each worker runs (``sys.executable`` unless ``--no_python``)."""
    entry_args: list[str]
    num_nodes: int = 1
    node_rank: int = 0
    master_addr: str = ""
    master_port: int | None = None
    visible_devices: list[int] | None = None
    """Sets ``CUDA_VISIBLE_DEVICES`` for the workers (``--include/--exclude``)."""
    log_dir: str | None = None
    bind_cores: list[int] | None = None
    """``--bind_cores_to_rank``: the cores the local ranks split (``_binding``)."""


def run_command(args: argparse.Namespace) -> int:
    """Handler of ``slipstream run``; returns the process exit code."""
    try:
        return _run(args)
    except LaunchError as err:
        print(f"slipstream run: error: {err}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    _check_target(args)
    _set_comm_timeout(args.comm_timeout)
    if args.as_deepspeed:
        os.environ[AS_DEEPSPEED_ENV] = "1"  # SLIPSTREAM_* variables reach every node
    if args.bind_core_list is not None and not args.bind_cores_to_rank:
        raise LaunchError("--bind_core_list needs --bind_cores_to_rank (as in DeepSpeed)")
    if args.no_ssh:
        plan = _node_plan(args)
        if args.stop_on_stdin_eof:
            _stop_on_stdin_eof()
        return launch_local(plan)
    resources, from_hostfile = _resources(args)
    first = next(iter(resources))
    if not from_hostfile or (len(resources) == 1 and is_local_host(first)):
        slots = resources[first]
        filtered = bool(args.include or args.exclude)
        return launch_local(_plan(args, len(slots), slots if filtered else None))
    return _launch_multinode(args, resources)


def _check_target(args: argparse.Namespace) -> None:
    if args.module and args.no_python:
        raise LaunchError("--module and --no_python cannot be combined")
    if args.nproc is not None and args.nproc < 1:
        raise LaunchError(f"--nproc {args.nproc}: must be at least 1")
    if args.module:
        return  # resolved by each rank, in its own sys.path
    if args.no_python:
        if shutil.which(args.script) is None:
            raise LaunchError(f"executable not found: {args.script}")
    elif not os.path.isfile(args.script):
        raise LaunchError(f"script not found: {args.script} (cwd: {os.getcwd()})")


def _set_comm_timeout(seconds: float | None) -> None:
    """Pass ``--comm_timeout`` to every rank (``SLIPSTREAM_*`` variables reach every node)."""
    if seconds is None:
        return
    if not (math.isfinite(seconds) and seconds > 0):
        raise LaunchError(f"--comm_timeout {seconds:g}: must be a positive number of seconds")
    os.environ[COMM_TIMEOUT_ENV] = f"{seconds:g}"


def _local_device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _resources(args: argparse.Namespace) -> tuple[ResourceMap, bool]:
    """The hosts and slots to use, and whether they came from a hostfile."""
    hostfile = args.hostfile
    if hostfile is None and os.path.isfile(DEFAULT_HOSTFILE):
        hostfile = DEFAULT_HOSTFILE
    if hostfile is not None:
        pool = parse_hostfile(hostfile)
    else:
        if args.num_nodes not in (None, 1):
            raise LaunchError(
                f"--num_nodes {args.num_nodes} needs a hostfile (-H) listing the hosts, "
                "or --no_ssh on each node"
            )
        pool = {"localhost": list(range(max(args.nproc or 0, _local_device_count(), 1)))}
    picked = select_resources(
        pool, include=args.include, exclude=args.exclude, num_nodes=args.num_nodes,
        nproc=args.nproc,
    )  # fmt: skip
    return picked, hostfile is not None


def _entry(args: argparse.Namespace) -> tuple[str, list[str]]:
    """What each worker runs: the per-rank entry module, which runs the script or module, or
    execs the executable (``--no_python``)."""
    # --no_python: the entry execs the executable after arming the parent-death signal.
    opts = [flag for flag, on in (("--module", args.module), ("--exec", args.no_python),
            ("--no_local_rank", args.no_local_rank)) if on]  # fmt: skip
    entry = ["-u", _RANK_ENTRY, *opts, args.script, *args.script_args]
    return sys.executable, entry


def _plan(
    args: argparse.Namespace,
    nproc: int,
    visible: list[int] | None,
    num_nodes: int = 1,
    node_rank: int = 0,
) -> LocalPlan:
    entrypoint, entry_args = _entry(args)
    port = args.master_port
    if port is None and num_nodes > 1:
        port = DEFAULT_MASTER_PORT
    return LocalPlan(
        nproc=nproc, entrypoint=entrypoint, entry_args=entry_args, num_nodes=num_nodes,
        node_rank=node_rank, master_addr=args.master_addr, master_port=port,
        visible_devices=visible, log_dir=args.enable_each_rank_log,
        bind_cores=plan_core_binding(args.bind_core_list, nproc) if args.bind_cores_to_rank
        else None,
    )  # fmt: skip


def _node_plan(args: argparse.Namespace) -> LocalPlan:
    """``--no_ssh``: this machine is node ``--node_rank`` of ``--num_nodes``."""
    num_nodes = args.num_nodes or 1
    if not 0 <= args.node_rank < num_nodes:
        raise LaunchError(f"--node_rank {args.node_rank}: must be in [0, --num_nodes {num_nodes})")
    if num_nodes > 1 and not args.master_addr:
        raise LaunchError("--no_ssh with --num_nodes > 1 needs --master_addr (node 0's address)")
    if args.world_info:
        hosts = decode_world_info(args.world_info)
        if len(hosts) != num_nodes:
            raise LaunchError(f"--world_info lists {len(hosts)} hosts, --num_nodes is {num_nodes}")
        slots = hosts[args.node_rank][1]
        visible = slots if args.set_visible_devices else None
    else:
        pool = {"localhost": list(range(max(args.nproc or 0, _local_device_count(), 1)))}
        slots = select_resources(pool, include=args.include, exclude=args.exclude,
                                 nproc=args.nproc)["localhost"]  # fmt: skip
        visible = slots if (args.include or args.exclude or args.set_visible_devices) else None
    return _plan(args, len(slots), visible, num_nodes=num_nodes, node_rank=args.node_rank)


def _stop_on_stdin_eof() -> None:
    """SIGTERM ourselves when stdin closes: the ssh connection from the fan-out went away
    (it stopped us after another node failed, or it died), so the agent stops our ranks."""

    def watch() -> None:
        # Raw reads: a daemon thread blocked in sys.stdin's buffered reader aborts shutdown.
        while os.read(0, 4096):
            pass
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="slipstream-stdin-watch", daemon=True).start()


def _launch_multinode(args: argparse.Namespace, resources: ResourceMap) -> int:
    names = ("module", "no_python", "no_local_rank", "bind_cores_to_rank")
    node_flags = [f"--{name}" for name in names if getattr(args, name)]
    if args.bind_core_list is not None:  # each node splits its own cores
        node_flags += ["--bind_core_list", args.bind_core_list]
    if args.enable_each_rank_log:
        node_flags += ["--enable_each_rank_log", args.enable_each_rank_log]
    master_addr = args.master_addr
    if not master_addr and is_local_host(next(iter(resources))):
        master_addr = socket.gethostname()  # "localhost" would mean each node itself
    spec = NodeLaunchSpec(
        script=args.script, script_args=list(args.script_args), master_addr=master_addr,
        master_port=args.master_port or DEFAULT_MASTER_PORT, flags=node_flags,
        launcher=args.launcher, launcher_args=_split(args.launcher_args),
        ssh_port=args.ssh_port, set_visible_devices=bool(args.include or args.exclude),
    )  # fmt: skip
    dirs = [Path.home(), Path.cwd()]
    exports = collect_exports(os.environ, dirs)
    commands = build_node_commands(resources, spec, cwd=os.getcwd(), exports=exports)
    if args.launcher == "pdsh" and shutil.which("pdsh") is None:
        raise LaunchError("--launcher pdsh: pdsh is not installed; use --launcher ssh")
    hosts = ", ".join(f"{h} ({len(s)})" for h, s in resources.items())
    _say(f"starting {sum(map(len, resources.values()))} ranks on {len(resources)} nodes: {hosts}")
    return run_parallel(commands)


def _split(text: str) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError as err:
        raise LaunchError(f"--launcher_args {text!r}: {err}") from None


def _say(msg: str) -> None:
    if not logging.getLogger("slipstream").isEnabledFor(logging.INFO):
        return  # SLIPSTREAM_LOG_LEVEL=WARNING, or `deepspeed --log_level warning` / -q
    print(f"[slipstream run] {msg}", file=sys.stderr, flush=True)


def _set_omp_threads(nproc: int) -> None:
    """One rank per core group: without this, N ranks x all-core OpenMP pools oversubscribe."""
    if "OMP_NUM_THREADS" in os.environ or nproc < 2:
        return
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = max(1, (cpus or 1) // nproc)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    _say(f"OMP_NUM_THREADS not set; using {threads} per rank ({cpus} CPUs / {nproc} ranks)")


def launch_local(plan: LocalPlan) -> int:
    """Run ``plan`` with torchrun's elastic agent; return 0 or the failing rank's exit code.

    When a rank fails, the agent stops the other ranks (SIGTERM, then SIGKILL after its
    shutdown timeout) and we print one line naming the rank that failed first, its exit code
    and where its traceback or output is, then one line per rank that failed only because a
    peer died (see :mod:`slipstream.cli._failures`). Workers die with this process even when it
    is killed by SIGKILL (see :mod:`slipstream.cli._rank_entry`).
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    _set_omp_threads(plan.nproc)
    if plan.visible_devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, plan.visible_devices))
    if plan.bind_cores is not None:
        os.environ[BIND_CORES_ENV] = ",".join(map(str, plan.bind_cores))
        per_rank = len(plan.bind_cores) // plan.nproc
        _say(f"binding each rank to {per_rank} of cores {plan.bind_cores} (OMP_NUM_THREADS)")
    if plan.num_nodes == 1 and plan.master_port is None and not plan.master_addr:
        # Like torchrun --standalone: the agent picks a free port, so jobs never collide.
        backend, endpoint, rdzv = "c10d", "localhost:0", {}
        run_id = f"slipstream-{uuid.uuid4().hex[:8]}"
    else:
        addr = plan.master_addr or "127.0.0.1"
        port = plan.master_port if plan.master_port is not None else DEFAULT_MASTER_PORT
        backend, endpoint, rdzv = "static", f"{addr}:{port}", {"rank": plan.node_rank}
        run_id = _STATIC_RUN_ID
    logs = DefaultLogsSpecs(log_dir=plan.log_dir)
    if plan.log_dir is not None:
        logs = DefaultLogsSpecs(log_dir=plan.log_dir, redirects=Std.ALL, tee=Std.ALL)
    config = LaunchConfig(
        min_nodes=plan.num_nodes, max_nodes=plan.num_nodes, nproc_per_node=plan.nproc,
        run_id=run_id, role="slipstream", rdzv_endpoint=endpoint, rdzv_backend=backend,
        rdzv_configs=rdzv, max_restarts=0, monitor_interval=0.1, start_method="spawn",
        logs_specs=logs, log_line_prefix_template="[rank${rank}]: " if plan.log_dir else None,
    )  # fmt: skip
    # Workers check this is still their parent, and die with it (see _rank_entry).
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    try:
        with track_worker_stops() as stops:
            elastic_launch(config, plan.entrypoint)(*plan.entry_args)
    except ChildFailedError as err:
        return _report_rank_failure(err, plan, run_id, stops)
    except SignalException as err:
        _say(f"received {signal.Signals(err.sigval).name}; stopped all ranks")
        return 128 + int(err.sigval)
    return 0


def _report_rank_failure(err: Any, plan: LocalPlan, run_id: str, stops: dict[int, float]) -> int:
    """Print which rank caused the failure (and which failed only because of it); return the
    cause's exit code."""
    failures = classify_failures(err.failures, stops)
    cause = failures[0]
    hint = None
    if cause.error_file is None and plan.log_dir is not None:
        pattern = os.path.join(plan.log_dir, f"{run_id}_*", "attempt_0", str(cause.local_rank))
        found = sorted(glob.glob(pattern), key=os.path.getmtime)
        if found:
            hint = f"its output is in {found[-1]}/stderr.log"
    for line in format_report(failures, hint):
        print(line, file=sys.stderr, flush=True)
    return job_exit_status(failures)
