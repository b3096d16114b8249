"""Build hook: ship ``slipstream_as_deepspeed.pth`` at the root of site-packages.

The .pth line runs at every interpreter start and, only when ``SLIPSTREAM_AS_DEEPSPEED`` is
set, installs the finder of ``_slipstream_as_deepspeed`` that makes ``import deepspeed``
slipstream (docs/compatibility.md). Everything else about the build is in pyproject.toml.
"""

from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH_NAME = "slipstream_as_deepspeed.pth"
# One line; site.py executes .pth lines that start with "import". The variable is checked
# before anything is imported, so a process without it pays nothing.
PTH_LINE = (
    "import os; os.environ.get('SLIPSTREAM_AS_DEEPSPEED', '').strip() not in ('', '0') "
    "and __import__('_slipstream_as_deepspeed').install_from_env()\n"
)


class BuildPyWithPth(build_py):
    """``build_py`` that also writes the .pth file beside the packages.

    A wheel takes it from ``build_lib``. An editable install (PEP 660) ignores ``build_lib``
    and packs the directory ``install_lib`` points at instead, so there it goes there. Its
    name sorts after setuptools' ``__editable__.*.pth``, whose finder must already be in
    place when this line imports ``_slipstream_as_deepspeed``.
    """

    def run(self) -> None:
        super().run()
        if self.editable_mode:
            target = Path(self.get_finalized_command("install").install_lib)
        else:
            target = Path(self.build_lib)
        target.mkdir(parents=True, exist_ok=True)
        (target / PTH_NAME).write_text(PTH_LINE, encoding="utf-8")

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = super().get_outputs(include_bytecode)
        if self.editable_mode:
            return outputs
        return [*outputs, str(Path(self.build_lib) / PTH_NAME)]


setup(cmdclass={"build_py": BuildPyWithPth})
