"""``SLIPSTREAM_AS_DEEPSPEED=1``: ``import deepspeed`` and every ``deepspeed.*`` is slipstream.

Frameworks that integrate DeepSpeed (the Hugging Face Trainer, Accelerate, Lightning) check
that a package named ``deepspeed`` is installed and import it by that name; user scripts mix
``import slipstream as deepspeed`` with ``from deepspeed.pipe import ...``. With the variable
set, a meta-path finder placed first on ``sys.meta_path`` answers every ``deepspeed`` import:

- ``deepspeed`` is a module that forwards attribute look-ups to ``slipstream`` and reports the
  DeepSpeed version slipstream follows as ``__version__``;
- ``deepspeed.X.Y`` is the module ``slipstream.X.Y`` itself (or the slipstream module named in
  ``REDIRECTS`` where DeepSpeed keeps the same names at another path);
- ``deepspeed.X`` where slipstream has no such module raises ``ModuleNotFoundError`` naming it:
  it never falls through to a real DeepSpeed, so the two libraries cannot mix;
- ``importlib.metadata.version("deepspeed")`` reports that DeepSpeed version.

The finder is installed at interpreter start by ``slipstream_as_deepspeed.pth``, which the
slipstream wheel (and an editable install) places in site-packages, so it holds in every
process: launcher ranks, DataLoader workers, spawned children. Without the variable nothing
is installed and a real DeepSpeed stays usable side by side.

This module is imported at interpreter start: it uses only the standard library and imports
slipstream only when a ``deepspeed`` import actually happens.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import runpy
import sys
import types
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "ENV",
    "REDIRECTS",
    "DeepSpeedAliasFinder",
    "deepspeed_version",
    "install",
    "install_from_env",
    "is_enabled",
    "is_installed",
    "uninstall",
]

ENV = "SLIPSTREAM_AS_DEEPSPEED"
_ON = frozenset({"1", "true", "yes", "on"})
_OFF = frozenset({"", "0", "false", "no", "off"})

REDIRECTS: dict[str, str] = {
    "deepspeed.runtime.zero": "slipstream.zero",
    "deepspeed.runtime.zero.partition_parameters": "slipstream.zero.partition_parameters",
    "deepspeed.runtime.pipe": "slipstream.pipe",
    "deepspeed.runtime.pipe.module": "slipstream.pipe",
    "deepspeed.runtime.pipe.engine": "slipstream.pipe",
    "deepspeed.checkpoint.utils": "slipstream.utils.torch_save",
    # DeepSpeed's documented import of get_model_profile / FlopsProfiler.
    "deepspeed.profiling.flops_profiler": "slipstream.profiling.flops",
}
"""DeepSpeed module paths whose names slipstream keeps in another module."""

_HINTS: dict[str, str] = {
    "deepspeed.runtime.activation_checkpointing": "use deepspeed.checkpointing (the same names)",
    "deepspeed.ops.op_builder": "slipstream compiles no ops; nothing needs building",
}


def is_enabled(value: str | None) -> bool:
    """Whether an ``SLIPSTREAM_AS_DEEPSPEED`` value turns the alias on.

    Raises:
        ValueError: a value that is neither on (1/true/yes/on) nor off (0/false/no/off/empty).
    """
    text = (value or "").strip().lower()
    if text in _ON:
        return True
    if text in _OFF:
        return False
    raise ValueError(
        f"{ENV}={value!r} is not understood: set it to 1 to make `import deepspeed` slipstream, "
        "or unset it (0) to leave `deepspeed` alone"
    )


def _slipstream_dir() -> Path:
    """slipstream's package directory, found without importing slipstream."""
    spec = importlib.util.find_spec("slipstream")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"{ENV} is set but slipstream is not importable", name="slipstream"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def deepspeed_version() -> str:
    """The DeepSpeed version slipstream follows (``slipstream.version.DEEPSPEED_VERSION``)."""
    return str(runpy.run_path(str(_slipstream_dir() / "version.py"))["DEEPSPEED_VERSION"])


def _target(fullname: str) -> str:
    """The slipstream module that answers the DeepSpeed module ``fullname``."""
    for alias in sorted(REDIRECTS, key=len, reverse=True):
        if fullname == alias or fullname.startswith(alias + "."):
            return REDIRECTS[alias] + fullname[len(alias) :]
    return "slipstream" + fullname[len("deepspeed") :]


def _not_provided(fullname: str, target: str) -> ModuleNotFoundError:
    hint = next((h for prefix, h in _HINTS.items() if fullname.startswith(prefix)), None)
    msg = (
        f"No module named '{fullname}': {ENV}=1 maps `deepspeed` to slipstream, and slipstream "
        f"does not provide '{fullname}' (looked for '{target}'). See docs/compatibility.md for "
        f"the DeepSpeed modules slipstream covers"
    )
    if hint:
        msg += f"; {hint}"
    return ModuleNotFoundError(msg + ".", name=fullname)


def _top_level_module(spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
    """``deepspeed`` itself: slipstream's names, DeepSpeed's version numbers."""
    slipstream = importlib.import_module("slipstream")
    version = deepspeed_version()
    module = types.ModuleType("deepspeed", slipstream.__doc__)
    major, minor, patch = (int(p) for p in version.split(".")[:3])

    def __getattr__(name: str) -> Any:
        return getattr(slipstream, name)

    def __dir__() -> list[str]:
        return sorted(set(dir(slipstream)) | set(module.__dict__))

    module.__dict__.update(
        __getattr__=__getattr__,
        __dir__=__dir__,
        __path__=list(slipstream.__path__),
        __version__=version,
        __version_major__=major,
        __version_minor__=minor,
        __version_patch__=patch,
        __git_hash__=None,
        __git_branch__=None,
        __slipstream_version__=slipstream.__version__,
    )
    return module


class _AliasLoader(importlib.abc.Loader):
    """Loads ``deepspeed.X`` as the already-imported slipstream module (same object)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._target_spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        if spec.name == "deepspeed":
            return _top_level_module(spec)
        module = importlib.import_module(self.target)
        self._target_spec = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        # The import system stamped the alias spec on the slipstream module; give it its own
        # back so that reload(), pickling by module and tools that read __spec__ see slipstream.
        alias = module.__spec__.name if module.__spec__ is not None else module.__name__
        if self._target_spec is not None:
            module.__spec__ = self._target_spec
        _attach_redirected_children(alias, module)


def _attach_redirected_children(alias: str, module: types.ModuleType) -> None:
    """Make ``from deepspeed.X import Y`` find a redirected ``deepspeed.X.Y``.

    ``from deepspeed.X import Y`` looks ``Y`` up as an attribute of ``deepspeed.X``, and when
    it is missing imports ``<module.__name__>.Y``: that is ``slipstream.<...>.Y``, the wrong
    name where ``deepspeed.X.Y`` is redirected elsewhere (``deepspeed.runtime.zero`` is
    ``slipstream.zero``, not ``slipstream.runtime.zero``). So the redirected children are set
    as attributes of the module answering ``deepspeed.X`` when it loads, as an
    ``import deepspeed.X.Y`` would have set them.
    """
    for child_alias in REDIRECTS:
        parent, _, child = child_alias.rpartition(".")
        if parent != alias or hasattr(module, child):
            continue
        try:
            setattr(module, child, importlib.import_module(child_alias))
        except ImportError:
            continue


class _AliasDistribution(importlib.metadata.Distribution):
    """The ``deepspeed`` distribution: slipstream, at the DeepSpeed version it follows."""

    def read_text(self, filename: str) -> str | None:
        if filename == "METADATA":
            return (
                "Metadata-Version: 2.1\nName: deepspeed\n"
                f"Version: {deepspeed_version()}\n"
                f"Summary: slipstream under DeepSpeed's name ({ENV}=1)\n"
            )
        return None

    def locate_file(self, path: Any) -> Path:
        return _slipstream_dir().parent / str(path)


class DeepSpeedAliasFinder(importlib.abc.MetaPathFinder):
    """Answers every ``deepspeed`` import with slipstream (first on ``sys.meta_path``)."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "deepspeed" and not fullname.startswith("deepspeed."):
            return None
        name = _target(fullname)
        try:
            found = importlib.util.find_spec(name)
        except ModuleNotFoundError:  # a parent of ``name`` is missing
            found = None
        if found is None:
            raise _not_provided(fullname, name)
        return importlib.machinery.ModuleSpec(
            fullname,
            _AliasLoader(name),
            is_package=found.submodule_search_locations is not None,
        )

    def find_distributions(self, context: Any = None) -> Iterator[importlib.metadata.Distribution]:
        name = getattr(context, "name", None)
        if name is None or name.lower().replace("-", "_").replace(".", "_") == "deepspeed":
            yield _AliasDistribution()


def is_installed() -> bool:
    """Whether the finder is on ``sys.meta_path``."""
    return any(isinstance(f, DeepSpeedAliasFinder) for f in sys.meta_path)


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (idempotent).

    Raises:
        RuntimeError: a real DeepSpeed is already imported in this process.
    """
    if is_installed():
        return
    loaded = sys.modules.get("deepspeed")
    if loaded is not None and not str(getattr(loaded, "__slipstream_version__", "")):
        raise RuntimeError(
            f"{ENV}: the real DeepSpeed ({getattr(loaded, '__file__', '?')}) is already imported "
            "in this process, so `deepspeed` cannot become slipstream; set the variable before "
            "Python starts (it is read at interpreter start)"
        )
    sys.meta_path.insert(0, DeepSpeedAliasFinder())


def uninstall() -> None:
    """Remove the finder and every ``deepspeed`` module it made (for tests)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, DeepSpeedAliasFinder)]
    for name in [n for n in sys.modules if n == "deepspeed" or n.startswith("deepspeed.")]:
        del sys.modules[name]


def install_from_env() -> None:
    """Install the finder when ``SLIPSTREAM_AS_DEEPSPEED`` says so (called by the .pth file).

    A value that is neither on nor off is reported on stderr and leaves ``deepspeed`` alone:
    an exception here would only print a traceback at every interpreter start.
    """
    try:
        enabled = is_enabled(os.environ.get(ENV))
    except ValueError as exc:
        sys.stderr.write(f"slipstream: {exc}\n")
        return
    if enabled:
        install()
