"""``deepspeed.launcher.multinode_runner``: the multi-node fan-out commands of the ``deepspeed``
command, as DeepSpeed's runner classes build them.

``PDSHRunner(args, world_info_base64).get_cmd(env, active_resources)`` returns
``(cmd, kill_cmd, env)``: one ``pdsh -S -w host,...`` line that runs slipstream's per-node
launcher (``slipstream run --no_ssh``, node rank from pdsh's ``%n``) on every host, the
matching ``pkill`` line, and the environment with ``PDSH_RCMD_TYPE=ssh`` (and the ssh port).
``args`` is ``deepspeed.launcher.runner.parse_args(...)``'s namespace; ``world_info_base64``
is :func:`deepspeed.launcher.runner.encode_world_info` of ``{host: slots}``.

The MPI and SLURM runners (``OpenMPIRunner``, ``MPICHRunner``, ``IMPIRunner``,
``MVAPICHRunner``, ``SlurmRunner``) are refused when built: slipstream's ranks rendezvous
through torchrun's agent, and ``init_distributed`` does no MPI discovery, so an ``mpirun`` or
``srun`` line would start ranks that cannot find each other. ``--launcher ssh`` or ``pdsh``
reach the same hosts.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import shlex
import shutil
from collections.abc import Mapping
from typing import Any

from slipstream.cli._multinode import NodeLaunchSpec, build_node_commands

__all__ = [
    "IMPIRunner",
    "MPICHRunner",
    "MVAPICHRunner",
    "MultiNodeRunner",
    "OpenMPIRunner",
    "PDSHRunner",
    "SlurmRunner",
]

PDSH_MAX_FAN_OUT = 1024


def _decode_world_info(text: str) -> dict[str, list[int]]:
    try:
        raw = json.loads(base64.urlsafe_b64decode(text))
    except (binascii.Error, ValueError) as err:
        raise ValueError(f"world_info {text!r} is not base64 JSON: {err}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"world_info {text!r} does not encode a {{host: slots}} mapping")
    return {
        str(h): list(range(s)) if isinstance(s, int) else [int(x) for x in s]
        for h, s in raw.items()
    }


class MultiNodeRunner:
    """Base of the runners: the parsed launcher ``args``, the encoded world and the
    variables to export on every node (``add_export``)."""

    def __init__(self, args: Any, world_info_base64: str) -> None:
        self.args = args
        self.validate_args()
        self.user_arguments = self.parse_user_args()
        self.user_script = args.user_script
        self.world_info_base64 = world_info_base64
        self.exports: dict[str, str] = {}

    def backend_exists(self) -> bool:
        raise NotImplementedError

    def get_cmd(self, environment: dict[str, str], active_resources: Mapping[str, Any]) -> Any:
        raise NotImplementedError

    def add_export(self, key: str, var: str) -> None:
        """Export ``key=var`` on every node (the value is quoted by the command builder)."""
        self.exports[key.strip()] = var.strip()

    def parse_user_args(self) -> list[str]:
        return list(self.args.user_args)

    @property
    def name(self) -> str:
        return type(self).__name__

    def validate_args(self) -> None:
        """Check ``args`` for this runner (nothing by default)."""


class PDSHRunner(MultiNodeRunner):
    """One ``pdsh`` for all hosts, each running slipstream's per-node launcher."""

    def backend_exists(self) -> bool:
        return shutil.which("pdsh") is not None

    @property
    def name(self) -> str:
        return "pdsh"

    def _spec(self) -> NodeLaunchSpec:
        a = self.args
        flags = [f"--{f}" for f in ("module", "no_python", "no_local_rank") if getattr(a, f)]
        if a.enable_each_rank_log not in (None, "None", ""):
            flags.append(f"--enable_each_rank_log={a.enable_each_rank_log}")
        return NodeLaunchSpec(
            script=self.user_script,
            script_args=self.user_arguments,
            master_addr=a.master_addr or "",
            master_port=a.master_port or 29500,
            flags=flags,
            launcher="pdsh",
            launcher_args=shlex.split(a.launcher_args),
            ssh_port=a.ssh_port,
            set_visible_devices=bool(a.include or a.exclude),
        )

    def get_cmd(
        self, environment: dict[str, str], active_resources: Mapping[str, Any]
    ) -> tuple[list[str], list[str], dict[str, str]]:
        """``(pdsh command, kill command, environment)`` for the hosts of the world info."""
        resources = _decode_world_info(self.world_info_base64)
        hosts = [h for h in active_resources if h in resources] or list(resources)
        resources = {h: resources[h] for h in hosts}
        (command,) = build_node_commands(
            resources, self._spec(), cwd=os.path.abspath("."), exports=self.exports
        )
        environment.update(command.env)
        pdsh = command.argv[:-1]
        kill = [*pdsh, "pkill -f 'slipstream.cli.main run --no_ssh'"]
        return command.argv, kill, environment


class _Refused(MultiNodeRunner):
    launcher = ""

    def __init__(self, args: Any, world_info_base64: str, resource_pool: Any = None) -> None:
        raise ValueError(
            f"--launcher {self.launcher}: slipstream does not launch through {self.launcher} "
            "(its ranks rendezvous through torchrun's agent and init_distributed does no MPI "
            "discovery); use --launcher pdsh or ssh, which reach the same hosts"
        )

    def backend_exists(self) -> bool:
        return False


class OpenMPIRunner(_Refused):
    """Refused (see the module docstring)."""

    launcher = "openmpi"


class MPICHRunner(_Refused):
    """Refused (see the module docstring)."""

    launcher = "mpich"


class IMPIRunner(_Refused):
    """Refused (see the module docstring)."""

    launcher = "impi"


class MVAPICHRunner(_Refused):
    """Refused (see the module docstring)."""

    launcher = "mvapich"


class SlurmRunner(_Refused):
    """Refused (see the module docstring)."""

    launcher = "slurm"
