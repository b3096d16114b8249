"""``deepspeed.monitor.utils``: is the library a monitor needs installed?"""

from __future__ import annotations

import importlib

__all__ = ["check_comet_availability", "check_tb_availability", "check_wandb_availability"]


def _check(module: str, install: str) -> None:
    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"this monitor needs the '{module}' package: pip install {install}"
        ) from exc


def check_tb_availability() -> None:
    """Raise ``ImportError`` (saying what to install) without ``tensorboard``."""
    _check("tensorboard", "tensorboard")


def check_wandb_availability() -> None:
    """Raise ``ImportError`` (saying what to install) without ``wandb``."""
    _check("wandb", "wandb")


def check_comet_availability() -> None:
    """Raise ``ImportError`` without ``comet_ml`` 3.41 or newer (DeepSpeed's floor)."""
    _check("comet_ml", '"comet_ml>=3.41.0"')
    from packaging.version import Version

    version = importlib.import_module("comet_ml").__version__
    if Version(version) < Version("3.41.0"):
        raise ImportError(f"comet_ml {version} is too old: pip install 'comet_ml>=3.41.0'")
