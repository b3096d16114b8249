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


MOQ_CASES = [
    # (quantization_type, rounding-nearest only, (start, target) bits, mixed fp16)
    ("symmetric", (8, 6), False),
    ("asymmetric", (6, 4), True),
    ("symmetric", (4, 1), False),
]


def moq_config(kind: str, bits: tuple[int, int], mixed: bool) -> dict[str, Any]:
    wq = m.weight_quantization(offset=0, groups=8, kind=kind, bits=(bits[1], bits[1]))
    wq["shared_parameters"]["quantize_weight_in_forward"] = False
    wq["shared_parameters"]["fp16_mixed_quantize"] = {
        "enabled": mixed,
        "quantize_change_ratio": 0.3,
    }
    for group in wq["different_groups"].values():
        group["params"].update(start_bits=bits[0], quantization_period=1)
    cfg = m.ds_config(weight_quantization=wq)
    cfg["fp16"] = {"enabled": True}
    return cfg


def moq_steps(which: str, steps: int = 7) -> list[list[torch.Tensor]]:
    """MoQ's quantizer alone on a tiny BERT's fp16 weights: ``steps`` quantize calls with the
    same deterministic update between them (the optimizer's part), weights after each."""
    out = []
    for kind, bits, mixed in MOQ_CASES:
        cfg = moq_config(kind, bits, mixed)
        model = m.tiny_bert(0)
        init, _, _, get_config = _library(which)
        init(model, copy.deepcopy(cfg))
        model.half()
        if which == "deepspeed":
            from deepspeed.runtime.quantize import Quantizer

            shared = get_config(copy.deepcopy(cfg))["weight_quantization"]["shared_parameters"]
            q = Quantizer(8, mixed, 0.3, kind, "nearest", False, False, False, 0)
            params = [p for p in model.parameters() if getattr(p, "start_bits", None)]
            assert shared["quantize_weight_in_forward"] is False

            def quantize(q: Any = q, params: list = params) -> None:
                q.quantize([params], False, False, None)
        else:
            from slipstream.compression.moq import MoQ

            moq = MoQ(model, get_config(cfg).weight_quantization.shared_parameters)
            quantize = moq.quantize
        gen = torch.Generator().manual_seed(3)
        snaps = []
        for _ in range(steps):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01 * torch.randn(p.shape, generator=gen).half())
            quantize()
            snaps.append(torch.cat([p.detach().float().flatten() for p in model.parameters()]))
        out.append(snaps)
    return out
