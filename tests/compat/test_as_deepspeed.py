"""SLIPSTREAM_AS_DEEPSPEED=1: every ``deepspeed`` import is slipstream in every process, names
slipstream lacks fail loudly, the metadata version is DeepSpeed's; without it nothing changes."""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

import _slipstream_as_deepspeed as alias
from slipstream.version import DEEPSPEED_VERSION
from tests.distributed.harness import run_code


def _python(
    code: str, value: str | None = "1", timeout: float = 120, fresh: bool = False
) -> subprocess.CompletedProcess:
    """``python -c CODE`` with ``SLIPSTREAM_AS_DEEPSPEED=value``: forked warm (the harness
    applies the variable as the .pth hook does at start), or a new interpreter (``fresh``)."""
    env = {k: v for k, v in os.environ.items() if k != alias.ENV}
    if value is not None:
        env[alias.ENV] = value
    if not fresh:
        return run_code(textwrap.dedent(code), env=env, timeout_s=timeout)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_deepspeed_modules_are_slipstream_in_a_fresh_interpreter() -> None:
    """The .pth hook installs the finder at startup: top level, submodules, redirects, a
    spawned child, and importlib.metadata all answer with slipstream."""
    proc = _python(
        """
        import importlib.metadata
        import deepspeed
        import slipstream
        from deepspeed.pipe import PipelineModule
        from deepspeed.accelerator import get_accelerator
        from deepspeed.ops.adam import FusedAdam
        from deepspeed.runtime.zero.partition_parameters import GatheredParameters
        from deepspeed.utils import safe_get_full_fp32_param
        import deepspeed.comm as dist
        assert deepspeed.initialize is slipstream.initialize
        assert PipelineModule is slipstream.pipe.PipelineModule
        assert GatheredParameters is slipstream.zero.GatheredParameters
        assert FusedAdam is slipstream.ops.adam.FusedAdam
        assert dist is slipstream.comm and dist.__spec__.name == "slipstream.comm"
        assert get_accelerator() is slipstream.accelerator.get_accelerator()
        assert deepspeed.zero is slipstream.zero
        import subprocess, sys
        child = subprocess.run(
            [sys.executable, "-c", "import deepspeed; print(deepspeed.__slipstream_version__)"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
        print(importlib.metadata.version("deepspeed"), deepspeed.__version__,
              deepspeed.__version_minor__, child == slipstream.__version__)
        """,
        fresh=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == [
        DEEPSPEED_VERSION,
        DEEPSPEED_VERSION,
        DEEPSPEED_VERSION.split(".")[1],
        "True",
    ]


def test_missing_module_names_itself_and_never_falls_through() -> None:
    """A DeepSpeed module slipstream lacks is a ModuleNotFoundError naming it, even with a
    real DeepSpeed installed."""
    proc = _python(
        """
        try:
            from deepspeed.no_such_module.layer import Thing
        except ModuleNotFoundError as e:
            print(e.name); print(e)
        """
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    name, msg = proc.stdout.split("\n", 1)
    assert name == "deepspeed.no_such_module"
    assert "slipstream does not provide 'deepspeed.no_such_module'" in msg


def test_without_the_variable_deepspeed_is_left_alone() -> None:
    """No variable: ``deepspeed`` is the real package when installed, else missing."""
    proc = _python(
        """
        import importlib.util
        spec = importlib.util.find_spec("deepspeed")
        print("none" if spec is None else spec.origin)
        """,
        value=None,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    origin = proc.stdout.strip()
    if importlib.util.find_spec("deepspeed") is None:
        assert origin == "none"
    else:
        assert origin.endswith(os.path.join("deepspeed", "__init__.py"))
        assert "slipstream" not in origin


def test_bad_value_is_reported_and_changes_nothing() -> None:
    proc = _python("import sys; print('deepspeed' in sys.modules)", value="maybe")
    assert proc.returncode == 0
    assert "SLIPSTREAM_AS_DEEPSPEED='maybe' is not understood" in proc.stderr
    assert proc.stdout.strip() == "False"


@pytest.mark.parametrize(
    "name, target",
    [
        ("deepspeed", "slipstream"),
        ("deepspeed.ops.adam", "slipstream.ops.adam"),
        ("deepspeed.runtime.zero", "slipstream.zero"),
        ("deepspeed.runtime.zero.partition_parameters", "slipstream.zero.partition_parameters"),
        ("deepspeed.runtime.pipe.module", "slipstream.pipe"),
        ("deepspeed.runtime.zeroX", "slipstream.runtime.zeroX"),
    ],
)
def test_module_mapping(name: str, target: str) -> None:
    assert alias._target(name) == target


def test_in_process_install_and_uninstall() -> None:
    """install() after a real DeepSpeed import is refused; otherwise it maps and undoes."""
    assert alias.is_enabled("1") and not alias.is_enabled("0") and not alias.is_enabled(None)
    real = sys.modules.get("deepspeed")
    if real is not None and not hasattr(real, "__slipstream_version__"):
        with pytest.raises(RuntimeError, match="already imported"):
            alias.install()
        return
    alias.install()
    try:
        importlib.import_module("deepspeed")
        assert sys.modules["deepspeed"].__slipstream_version__
        with pytest.raises(ModuleNotFoundError, match=r"deepspeed\.no_such_module"):
            importlib.import_module("deepspeed.no_such_module")
        assert importlib.import_module("deepspeed.moe.layer").MoE.__module__ == (
            "slipstream.moe.layer"
        )
    finally:
        alias.uninstall()
    assert "deepspeed" not in sys.modules and not alias.is_installed()
