"""Tests for `slipstream report`: text and JSON output, /proc/meminfo parsing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from slipstream.cli import report
from slipstream.version import __version__
from tests.distributed.harness import run_cli

REPO = Path(__file__).resolve().parents[2]
SECTIONS = {"slipstream", "python", "torch", "devices", "distributed", "system", "packages", "ops"}


def slipstream(*args: str) -> subprocess.CompletedProcess[str]:
    """The command in a process of its own, forked warm (no seconds spent importing torch)."""
    return run_cli(args, cwd=REPO, timeout_s=60)


def test_report_json_has_every_section_and_key_facts():
    result = slipstream("report", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert set(data) == SECTIONS
    assert data["slipstream"]["version"] == __version__
    assert Path(data["slipstream"]["path"]).name == "slipstream"
    assert data["python"]["version"] == ".".join(map(str, sys.version_info[:3]))
    assert {"version", "cuda_build", "hip_build"} <= set(data["torch"])
    assert {"cuda_available", "cuda_device_count", "cuda_devices", "bf16_cuda"} <= set(
        data["devices"]
    )
    assert data["distributed"]["gloo"] is True
    assert {"nccl", "nccl_version", "mpi"} <= set(data["distributed"])
    assert data["system"]["cpu_count"] >= 1
    assert data["system"]["memory"]["total_gib"] > 0
    assert set(report.OPTIONAL_PACKAGES) == set(data["packages"])
    assert data["ops"]["compiled"] == []


def test_report_text_lists_sections_and_says_nothing_is_compiled():
    result = slipstream("report")
    assert result.returncode == 0, result.stderr
    for section in SECTIONS:
        assert f"\n{section}:" in f"\n{result.stdout}"
    assert f"version                 {__version__}" in result.stdout
    assert "no ops are compiled, nothing to build" in result.stdout


def test_meminfo_parses_total_and_available_in_gib(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16777216 kB\nMemFree: 1 kB\nMemAvailable:    8388608 kB\n")
    assert report._meminfo(str(meminfo)) == {"total_gib": 16.0, "available_gib": 8.0}
    assert report._meminfo(str(tmp_path / "missing")) == {"total_gib": None, "available_gib": None}


def test_format_report_warns_about_small_dev_shm():
    data = {"system": {"dev_shm_gib": 0.06, "dev_shm_small": True}}
    text = report.format_report(data)
    assert "warning: /dev/shm is under 1 GiB" in text
