"""Every DeepSpeedExamples config with a ``compression_training`` or ``sparse_attention`` block
is either honoured (each enabled technique kept in the typed config) or refused with an error
naming the block; none is silently dropped.

Reads a DeepSpeedExamples checkout (``DEEPSPEED_EXAMPLES``: a work tree, or a bare git
directory) and skips without one. Run as a script to print the report:
``python tests/compat/test_examples_compression_configs.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from slipstream.config import ConfigError
from slipstream.config.loader import read_config

_DEFAULT = "/work/.mirror/deepspeedai+DeepSpeedExamples/repo"
_BLOCKS = ("compression_training", "sparse_attention")


def _source() -> Path | None:
    path = Path(os.environ.get("DEEPSPEED_EXAMPLES", _DEFAULT))
    return path if path.exists() else None


def _is_git_dir(path: Path) -> bool:
    return (path / "HEAD").is_file() and (path / "objects").is_dir()


def example_configs(root: Path) -> dict[str, str]:
    """Path -> text of every JSON file in the checkout mentioning one of the blocks."""
    if _is_git_dir(root):
        git = ["git", f"--git-dir={root}"]
        listed = subprocess.run(
            [*git, "grep", "-l", "-e", _BLOCKS[0], "-e", _BLOCKS[1], "HEAD", "--", "*.json"],
            capture_output=True,
            text=True,
        ).stdout.split()
        names = [n.removeprefix("HEAD:") for n in listed]
        return {
            n: subprocess.run(
                [*git, "show", f"HEAD:{n}"], capture_output=True, text=True, check=True
            ).stdout
            for n in names
        }
    found = {}
    for path in sorted(root.rglob("*.json")):
        text = path.read_text(errors="replace")
        if any(b in text for b in _BLOCKS):
            found[str(path.relative_to(root))] = text
    return found


def _enabled_in_raw(block: dict[str, Any]) -> set[str]:
    on = set()
    for key, tech in block.items():
        shared = tech.get("shared_parameters", tech) if isinstance(tech, dict) else {}
        if shared.get("enabled"):
            on.add(key)
    return on


def classify(text: str) -> tuple[str, str]:
    """("honoured" | "refused" | "not JSON", detail) for one config's text."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        return "not JSON", f"a template, not a config ({exc.msg} at line {exc.lineno})"
    try:
        cfg = read_config(raw)
    except ConfigError as exc:
        return "refused", str(exc)
    kept = {k for k, t in cfg.compression_training.techniques().items() if t.enabled}
    if cfg.compression_training.layer_reduction.enabled:
        kept.add("layer_reduction")
    wanted = _enabled_in_raw(raw.get("compression_training", {}))
    assert kept == wanted, f"techniques dropped: {sorted(wanted - kept)}"
    assert "sparse_attention" not in raw, "a sparse_attention block was accepted"
    return "honoured", ", ".join(sorted(kept)) or "every technique disabled"


def report(root: Path) -> dict[str, tuple[str, str]]:
    return {name: classify(text) for name, text in example_configs(root).items()}


@pytest.mark.skipif(_source() is None, reason="needs a DeepSpeedExamples checkout")
def test_each_example_config_is_honoured_or_refused_by_name() -> None:
    root = _source()
    assert root is not None
    results = report(root)
    assert len(results) >= 15, sorted(results)
    for name, (verdict, detail) in results.items():
        assert verdict in ("honoured", "refused", "not JSON"), name
        if verdict == "refused":
            assert any(f"'{b}" in detail for b in _BLOCKS), f"{name}: {detail}"


if __name__ == "__main__":
    src = _source()
    if src is None:
        raise SystemExit("set DEEPSPEED_EXAMPLES to a DeepSpeedExamples checkout or git dir")
    res = report(src)
    for n, (v, d) in sorted(res.items()):
        print(f"{v:9s} {n}\n          {d[:300]}")
    counts = {v: sum(1 for x, _ in res.values() if x == v) for v in ("honoured", "refused")}
    print(f"{len(res)} configs: {counts['honoured']} honoured, {counts['refused']} refused")
