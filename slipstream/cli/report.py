"""``slipstream report``: the environment facts a bug report needs (like ``ds_report``).

slipstream is pure Python, so unlike ``ds_report`` there is no op table: the report says
that nothing is compiled and lists what actually decides behaviour (torch build, devices,
distributed backends, memory, ``/dev/shm``, optional packages). ``--json`` prints the same
data as one JSON object (section -> field -> value).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

__all__ = ["OPTIONAL_PACKAGES", "add_parser", "collect_report", "format_report", "report_command"]

OPTIONAL_PACKAGES = ("transformers", "deepspeed", "triton", "safetensors", "pydantic", "hjson")
_SMALL_SHM = 1 << 30  # DataLoader workers pass batches through /dev/shm; Docker's default is 64 MiB


def add_parser(subparsers: Any) -> None:
    """Register ``report`` on the ``slipstream`` subcommand parser."""
    p = subparsers.add_parser(
        "report", help="print the environment for bug reports (like ds_report)",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(handler=report_command)


def report_command(args: argparse.Namespace) -> int:
    """Handler of ``slipstream report``."""
    data = collect_report()
    print(json.dumps(data, indent=2) if args.json else format_report(data))
    return 0


def _slipstream_info() -> dict[str, Any]:
    from slipstream.version import __version__

    return {"version": __version__, "path": str(Path(__file__).resolve().parents[1])}


def _python_info() -> dict[str, Any]:
    return {
        "version": platform.python_version(),
        "executable": sys.executable,
        "platform": platform.platform(),
    }


def _torch_info(torch: Any) -> dict[str, Any]:
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "version": torch.__version__,
        "path": str(Path(torch.__file__).parent),
        "cuda_build": torch.version.cuda,
        "hip_build": getattr(torch.version, "hip", None),
        "cudnn": cudnn,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


def _device_info(torch: Any) -> dict[str, Any]:
    available = torch.cuda.is_available()
    devices = []
    for index in range(torch.cuda.device_count() if available else 0):
        props = torch.cuda.get_device_properties(index)
        devices.append({
            "index": index,
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "memory_gib": round(props.total_memory / 2**30, 1),
        })  # fmt: skip
    accel = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    return {
        "accelerator": None if accel is None else str(accel),
        "cuda_available": available,
        "cuda_device_count": len(devices),
        "cuda_devices": devices,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "bf16_cuda": bool(available and torch.cuda.is_bf16_supported()),
        # bf16 runs on every CPU; these instruction sets make it fast rather than emulated.
        "bf16_cpu_native_isa": _cpu_bf16_flags() or None,
        "mps_available": bool(torch.backends.mps.is_available()),
    }


def _cpu_bf16_flags(path: str = "/proc/cpuinfo") -> list[str]:
    """CPU flags that execute bf16 natively (Linux ``/proc/cpuinfo``; empty elsewhere)."""
    try:
        with open(path) as fp:
            flags = next((line for line in fp if line.startswith("flags")), "")
    except OSError:
        return []
    return [f for f in ("avx512_bf16", "amx_bf16") if f in flags.split()]


def _distributed_info(torch: Any) -> dict[str, Any]:
    import torch.distributed as dist

    available = dist.is_available()
    nccl = available and dist.is_nccl_available()
    nccl_version = None
    if nccl:
        version = torch.cuda.nccl.version()
        nccl_version = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    return {
        "available": available,
        "gloo": bool(available and dist.is_gloo_available()),
        "nccl": bool(nccl),
        "nccl_version": nccl_version,
        "mpi": bool(available and dist.is_mpi_available()),
    }


def _meminfo(path: str = "/proc/meminfo") -> dict[str, float | None]:
    """MemTotal and MemAvailable in GiB from ``/proc/meminfo`` (None where unreadable)."""
    values: dict[str, float | None] = {"total_gib": None, "available_gib": None}
    keys = {"MemTotal": "total_gib", "MemAvailable": "available_gib"}
    try:
        for line in Path(path).read_text().splitlines():
            name, _, rest = line.partition(":")
            if name in keys:
                values[keys[name]] = round(int(rest.split()[0]) / 2**20, 1)  # kB -> GiB
    except (OSError, ValueError, IndexError):
        pass
    return values


def _shm_gib(path: str = "/dev/shm") -> float | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return round(st.f_blocks * st.f_frsize / 2**30, 2)


def _system_info() -> dict[str, Any]:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    shm = _shm_gib()
    return {
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "memory": _meminfo(),
        "dev_shm_gib": shm,
        "dev_shm_small": shm is not None and shm * 2**30 < _SMALL_SHM,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }


def _packages() -> dict[str, str | None]:
    """Installed versions, read from package metadata without importing the packages."""
    versions: dict[str, str | None] = {}
    for name in OPTIONAL_PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def collect_report() -> dict[str, Any]:
    """Gather the report as a JSON-serialisable ``{section: {field: value}}`` dict."""
    import torch

    return {
        "slipstream": _slipstream_info(),
        "python": _python_info(),
        "torch": _torch_info(torch),
        "devices": _device_info(torch),
        "distributed": _distributed_info(torch),
        "system": _system_info(),
        "packages": _packages(),
        "ops": {
            "compiled": [],
            "note": "slipstream is pure Python: no ops are compiled, nothing to build",
        },
    }


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list):
        return ", ".join(map(str, value)) or "-"
    return str(value)


def format_report(data: dict[str, Any]) -> str:
    """Human-readable text of :func:`collect_report` output."""
    lines: list[str] = []
    for section, fields in data.items():
        lines.append(f"{section}:")
        for key, value in fields.items():
            if key == "cuda_devices":
                for dev in value:
                    lines.append(
                        f"  cuda:{dev['index']:<18} {dev['name']} (capability "
                        f"{dev['capability']}, {dev['memory_gib']} GiB)"
                    )
            elif key == "memory":
                lines.append(f"  {'memory_gib':<23} total {_fmt(value['total_gib'])}, "
                             f"available {_fmt(value['available_gib'])}")  # fmt: skip
            elif section == "packages":
                lines.append(f"  {key:<23} {_fmt(value) if value else 'not installed'}")
            elif key == "compiled":
                lines.append(f"  {key:<23} none")
            else:
                lines.append(f"  {key:<23} {_fmt(value)}")
        if section == "system" and fields.get("dev_shm_small"):
            lines.append("  warning: /dev/shm is under 1 GiB; DataLoader workers may fail "
                         "(docker run --shm-size=8g or --ipc=host)")  # fmt: skip
    return "\n".join(lines)
