"""Module-level runs of init_compression / schedule / redundancy_clean on slipstream and on
DeepSpeed's compression library (a release that ships it), one process each."""

from __future__ import annotations

import copy
from typing import Any

import torch

from tests.compression import _models as m


def _library(which: str) -> tuple[Any, Any, Any, Any]:
    if which == "deepspeed":
        from tests.compat._deepspeed import import_deepspeed

        import_deepspeed()
        from deepspeed.compression.compress import init_compression, redundancy_clean
        from deepspeed.compression.config import get_compression_config
        from deepspeed.compression.scheduler import compression_scheduler

        return init_compression, redundancy_clean, compression_scheduler, get_compression_config
    from slipstream.compression.compress import init_compression, redundancy_clean
    from slipstream.compression.config import get_compression_config
    from slipstream.compression.scheduler import CompressionScheduler

    return init_compression, redundancy_clean, CompressionScheduler, get_compression_config


def student_init(which: str) -> dict[str, torch.Tensor]:
    init, _, _, _ = _library(which)
    teacher, student = m.tiny_bert(1), m.tiny_bert(2, layers=2)
    init(student, m.ds_config(layer_reduction=m.layer_reduction([1, 3])), teacher_model=teacher)
    return {k: v.clone() for k, v in student.state_dict().items()}


def pruning(which: str, cfg: dict[str, Any], conv: bool, steps: int) -> dict[str, Any]:
    """Prepare, copy learned scores from a seeded source (so both libraries start from the
    same scores), step the schedule, record forwards, then clean."""
    init, clean, scheduler, get_config = _library(which)
    model = m.tiny_cnn(0) if conv else m.tiny_bert(0)
    init(model, copy.deepcopy(cfg))
    model.eval()  # DeepSpeed's replacement modules start in training mode
    gen = torch.Generator().manual_seed(7)
    for name, p in sorted(model.named_parameters()):
        if "scores" in name:
            p.data.copy_(torch.randn(p.shape, generator=gen))
    sched = scheduler(model, get_config(copy.deepcopy(cfg)))
    x = m.cnn_batch(1) if conv else m.batch(1)[0]
    outs = []
    sparse = "sparse_pruning" in cfg["compression_training"]
    offset = next(iter(cfg["compression_training"].values()))["shared_parameters"]
    for step in range(steps):
        if sparse:  # DeepSpeed's scheduler cannot run l1/topk sparse pruning (see the test)
            for mod in model.modules():
                if (
                    getattr(mod, "sparse_pruning_method", None)
                    and step >= offset["schedule_offset"]
                ):
                    mod.sparse_pruning_enabled = True
        else:
            sched.step(step_zero_check=step == 0)
        with torch.no_grad():
            outs.append(model(x))
    clean(model, copy.deepcopy(cfg))
    with torch.no_grad():
        outs.append(model(x))
    state = {k: v.clone() for k, v in model.state_dict().items() if "scores" not in k}
    return {"outs": outs, "state": state}


def all_runs(which: str, cases: list[tuple[dict[str, Any], bool, int]]) -> dict[str, Any]:
    return {
        "student": student_init(which),
        "pruning": [pruning(which, cfg, conv, steps) for cfg, conv, steps in cases],
    }
