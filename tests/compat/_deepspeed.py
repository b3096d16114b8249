"""Import the installed DeepSpeed inside a spawned gloo rank, CPU only, compiling nothing."""

from __future__ import annotations

import importlib
import logging
import os
from typing import Any


def import_deepspeed() -> Any:
    """``deepspeed`` on its CPU accelerator over the rank's existing gloo group.

    DeepSpeed's torch backend JIT-builds a shared-memory all-reduce op (needs a compiler and
    tens of seconds) that only ``inference_all_reduce`` uses; ``None`` is DeepSpeed's own
    "op not available" value, so it is stubbed to that.
    """
    os.environ["DS_ACCELERATOR"] = "cpu"
    deepspeed = importlib.import_module("deepspeed")
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    for name in ("DeepSpeed", "deepspeed"):
        logging.getLogger(name).setLevel(logging.WARNING)
    return deepspeed
