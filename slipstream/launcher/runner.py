"""``deepspeed.launcher.runner``: the ``deepspeed`` command on slipstream's launcher.

DeepSpeed's console script is ``from deepspeed.launcher.runner import main; main()``. Under
``SLIPSTREAM_AS_DEEPSPEED=1`` that is :func:`main` here: it reads DeepSpeed's launcher flags
and runs ``slipstream run`` (torchrun's elastic agent; ssh/pdsh fan-out across a hostfile),
which takes the same flags under the same names. The ranks inherit the environment, so the
switch holds in them too and the unchanged script's ``import deepspeed`` is slipstream.

Flags that have nothing to act on in slipstream's launcher are refused by name with the
reason (elastic training, autotuning, ``--save_pid``, ``--force_multi``, ``--venv_script``,
MPI and SLURM launchers); ``--no_ssh_check`` is accepted: slipstream runs no ssh check to skip.
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import re
import sys
from collections.abc import Mapping
from pathlib import Path

from slipstream.cli.launcher import DEEPSPEED_ENVIRONMENT_NAME, DEFAULT_HOSTFILE
from slipstream.cli.main import main as slipstream_main

__all__ = ["DEEPSPEED_ENVIRONMENT_NAME", "main", "parse_args", "run_argv"]
__all__ += ["encode_world_info", "fetch_hostfile", "parse_inclusion_exclusion"]
__all__ += ["parse_node_config", "parse_node_config_list", "parse_resource_filter"]

_LAUNCHERS = ("ssh", "pdsh")  # DeepSpeed also has openmpi, mpich, impi, mvapich, slurm


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="deepspeed",
        description="DeepSpeed's launcher flags, run by slipstream's launcher (slipstream run)",
    )
    p.add_argument("-H", "--hostfile", default=None,
                   help=f"'hostname slots=N' per line (default {DEFAULT_HOSTFILE} if it exists)")  # fmt: skip
    p.add_argument("-i", "--include", default="", help="hosts/slots to use")
    p.add_argument("-e", "--exclude", default="", help="hosts/slots to skip")
    p.add_argument("--num_nodes", type=int, default=-1, help="use the first K hosts")
    p.add_argument("--min_elastic_nodes", type=int, default=-1, help="refused: no elastic jobs")
    p.add_argument("--max_elastic_nodes", type=int, default=-1, help="refused: no elastic jobs")
    p.add_argument("--num_gpus", "--num_accelerators", dest="num_gpus", type=int, default=-1,
                   help="processes per node")  # fmt: skip
    p.add_argument("--master_port", type=int, default=None,
                   help="rendezvous port (default: 29500; one node: a free port)")  # fmt: skip
    p.add_argument("--master_addr", default="", help="rendezvous host")
    p.add_argument("--node_rank", type=int, default=-1, help="this node's rank (--no_ssh)")
    p.add_argument("--launcher", default=None, help="multi-node fan-out: ssh or pdsh")
    p.add_argument("--launcher_args", default="", help="extra options for ssh/pdsh")
    p.add_argument("--module", action="store_true", help="run the script as a module")
    p.add_argument("--no_python", action="store_true", help="the script is an executable")
    p.add_argument("--no_local_rank", action="store_true", help="no --local_rank argument")
    p.add_argument("--no_ssh", action="store_true", help="run only this node's ranks")
    p.add_argument("--no_ssh_check", action="store_true",
                   help="accepted: slipstream runs no passwordless-ssh check")  # fmt: skip
    p.add_argument("--force_multi", action="store_true", help="refused (see --no_ssh)")
    p.add_argument("--save_pid", action="store_true", help="refused")
    p.add_argument("--enable_each_rank_log", default="None", help="per-rank log directory")
    p.add_argument("--autotuning", default="", choices=["tune", "run"],
                   help="refused: use `slipstream tune`")  # fmt: skip
    p.add_argument("--elastic_training", action="store_true", help="refused: no elastic jobs")
    p.add_argument("--bind_cores_to_rank", action="store_true", help="pin ranks to cores")
    p.add_argument("--bind_core_list", default=None, help="cores to share out")
    p.add_argument("--ssh_port", type=int, default=None, help="ssh port of remote hosts")
    p.add_argument("--venv_script", default=None, help="refused")
    p.add_argument("--log_level", default="info",
                   choices=["debug", "info", "warning", "error", "critical"],
                   help="the launcher's messages")  # fmt: skip
    p.add_argument("-q", "--quiet", action="store_true", help="--log_level error")
    p.add_argument("user_script", help="training script (module with --module)")
    p.add_argument("user_args", nargs=argparse.REMAINDER, help="the script's arguments")
    return p


def parse_args(args: list[str] | None = None) -> argparse.Namespace:
    """DeepSpeed's ``runner.parse_args``: its flags, its defaults where they have one."""
    return _parser().parse_args(args)


def _refusals(ns: argparse.Namespace) -> list[str]:
    out = []
    if ns.elastic_training or ns.min_elastic_nodes != -1 or ns.max_elastic_nodes != -1:
        out.append(
            "--elastic_training/--min_elastic_nodes/--max_elastic_nodes: slipstream's launcher "
            "runs a fixed world (a failed rank stops the job); remove them"
        )
    if ns.autotuning:
        out.append(f"--autotuning {ns.autotuning}: use `slipstream tune` to search a layout")
    if ns.save_pid:
        out.append("--save_pid: slipstream writes no pid file; remove it")
    if ns.force_multi:
        out.append(
            "--force_multi: slipstream starts one node's ranks with --no_ssh (and --node_rank, "
            "--num_nodes, --master_addr), or fans out over the hostfile; remove it"
        )
    if ns.venv_script:
        out.append(
            f"--venv_script {ns.venv_script}: slipstream runs the remote ranks with the "
            "launcher's Python; activate the environment in the shell the hosts' ssh starts"
        )
    if ns.launcher is not None and ns.launcher.lower() not in _LAUNCHERS:
        out.append(
            f"--launcher {ns.launcher}: slipstream fans out over ssh or pdsh "
            "(MPI and SLURM launchers are not implemented); use --launcher ssh or pdsh"
        )
    return out


def run_argv(ns: argparse.Namespace) -> list[str]:
    """The ``slipstream run`` arguments that do what DeepSpeed's flags in ``ns`` ask."""
    argv = ["run"]
    valued = {
        "--hostfile": ns.hostfile,
        "--include": ns.include or None,
        "--exclude": ns.exclude or None,
        "--num_nodes": ns.num_nodes if ns.num_nodes != -1 else None,
        "--nproc": ns.num_gpus if ns.num_gpus != -1 else None,
        "--master_port": ns.master_port,
        "--master_addr": ns.master_addr or None,
        "--node_rank": ns.node_rank if ns.node_rank != -1 else None,
        "--launcher": ns.launcher.lower() if ns.launcher else None,
        "--launcher_args": ns.launcher_args or None,
        "--enable_each_rank_log": None
        if ns.enable_each_rank_log in ("None", "")
        else ns.enable_each_rank_log,
        "--bind_core_list": ns.bind_core_list,
        "--ssh_port": ns.ssh_port,
    }
    for flag, value in valued.items():
        if value is not None:
            argv.append(f"{flag}={value}")
    for flag in ("module", "no_python", "no_local_rank", "no_ssh", "bind_cores_to_rank"):
        if getattr(ns, flag):
            argv.append("--" + flag)
    return [*argv, ns.user_script, *ns.user_args]


def main(args: list[str] | None = None) -> None:
    """The ``deepspeed`` command: launch ``user_script`` with slipstream's launcher; exits
    with the failing rank's exit code, as DeepSpeed's does.

    Raises:
        ValueError: ``--num_nodes``/``--num_gpus`` together with ``--include``/``--exclude``
            (DeepSpeed refuses the mix the same way).
    """
    ns = parse_args(args)
    if (ns.num_nodes >= 0 or ns.num_gpus >= 0) and (ns.include or ns.exclude):
        raise ValueError(
            "Cannot specify num_nodes/gpus with include/exclude: pick the hosts and slots with "
            "-i/-e, or count them with --num_nodes/--num_gpus"
        )
    refused = _refusals(ns)
    if refused:
        _parser().error("; ".join(refused))
    level = "error" if ns.quiet else ns.log_level
    logging.getLogger("slipstream").setLevel(level.upper())
    code = slipstream_main(run_argv(ns))
    if code:
        sys.exit(code)


# DeepSpeed's hostfile and resource-filter helpers, with its semantics (``ValueError`` on bad
# input; a host named twice in a filter merges its slots; a filter may leave nothing).
# slipstream's own launcher (slipstream.cli._hostfile) reads the same syntax more strictly.

_HOSTFILE_LINE = re.compile(r"^(\S+)\s+slots=(\d+)")


def _parse_hostfile(hostfile_lines: list[str]) -> dict[str, int]:
    """``{host: slots}`` from hostfile lines (``#`` comments and blank lines skipped).

    Raises:
        ValueError: a malformed line, a host listed twice, or no host at all.
    """
    pool: dict[str, int] = {}
    for raw in hostfile_lines:
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _HOSTFILE_LINE.search(line)
        if match is None:
            raise ValueError(f"Hostfile contains a bad entry: {line!r}; expected 'host slots=N'")
        host = match.group(1)
        if host in pool:
            raise ValueError(f"Hostfile contains multiple entries for {host}")
        pool[host] = int(match.group(2))
    if not pool:
        raise ValueError("Hostfile is empty or not formatted correctly ('host slots=N' lines)")
    return pool


def fetch_hostfile(hostfile_path: str | None) -> dict[str, int] | None:
    """The hostfile's ``{host: slots}``, or None when the file does not exist."""
    if not hostfile_path or not Path(hostfile_path).is_file():
        return None
    return _parse_hostfile(Path(hostfile_path).read_text().splitlines())


def parse_node_config(node_config: str) -> tuple[str, list[int]]:
    """``"host:0,2"`` is ``("host", [0, 2])``; ``"host"`` is ``("host", [])`` (all slots)."""
    if ":" not in node_config:
        return node_config, []
    host, slots = node_config.split(":")
    return host, [int(x) for x in slots.split(",")]


def parse_node_config_list(node_config_list: str) -> dict[str, list[int]]:
    """``"a:0@b@a:1"`` is ``{"a": [0, 1], "b": []}``: ``@``-separated, slots merged, sorted."""
    merged: dict[str, set[int]] = {}
    for node_config in node_config_list.split("@"):
        host, slots = parse_node_config(node_config)
        merged.setdefault(host, set()).update(slots)
    return {host: sorted(slots) for host, slots in merged.items()}


def parse_resource_filter(
    host_info: Mapping[str, list[int]], include_str: str = "", exclude_str: str = ""
) -> dict[str, list[int]]:
    """``host_info`` ({host: slots}) filtered by ``-i``/``-e`` syntax (``NODE[:SLOT,...]``
    joined by ``@``), hosts in ``host_info``'s order; hosts left with no slot are dropped.

    Raises:
        ValueError: both filters, an unknown host or slot, or a malformed filter.
    """
    if include_str and exclude_str:
        raise ValueError("include_str and exclude_str are mutually exclusive")
    if not include_str and not exclude_str:
        return dict(host_info)
    including = bool(include_str)
    chosen: dict[str, list[int]] = {} if including else {h: list(s) for h, s in host_info.items()}
    for host, slots in parse_node_config_list(include_str or exclude_str).items():
        if host not in host_info:
            raise ValueError(f"Hostname '{host}' not found in hostfile")
        for slot in slots:
            if slot not in host_info[host]:
                raise ValueError(f"No slot '{slot}' specified on host '{host}'")
        if including:
            chosen[host] = list(slots) if slots else list(host_info[host])
        else:
            chosen[host] = [s for s in chosen[host] if s not in slots] if slots else []
    return {host: list(dict.fromkeys(chosen[host])) for host in host_info if chosen.get(host)}


def parse_inclusion_exclusion(
    resource_pool: Mapping[str, int], inclusion: str, exclusion: str
) -> dict[str, list[int]]:
    """The active ``{host: slots}`` of a ``{host: slot count}`` pool after ``-i``/``-e``."""
    configs = parse_node_config_list(inclusion) if inclusion else {}
    active = {h: configs.get(h) or list(range(n)) for h, n in resource_pool.items()}
    return parse_resource_filter(active, include_str=inclusion, exclude_str=exclusion)


def encode_world_info(world_info: Mapping[str, object]) -> str:
    """``world_info`` as URL-safe base64 JSON (the launcher's ``--world_info``)."""
    return base64.urlsafe_b64encode(json.dumps(world_info).encode("utf-8")).decode("utf-8")
