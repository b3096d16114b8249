"""Rank bodies for sequence parallelism composed with checkpoints, packing, bf16 and
activation checkpointing on a tiny HF LLaMA (4 heads, 2 KV heads); batches are fed by hand
(the global batches of ``_hf_workloads``, sharded here), so a run can resume at any step."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tests.sequence import _hf_workloads as hw

MODEL = "llama_gqa2"
SAVE_AT, TOTAL = 2, 4  # steps before the checkpoint, steps in all
STAGE = {"ulysses": 2, "ring": 3}


def config(mode: str, sp: int, stage: int, **extra: Any) -> dict[str, Any]:
    cfg = hw._config(stage, sp)
    if sp > 1:
        cfg["sequence_parallel_mode"] = mode
    cfg.update(extra)
    return cfg


def global_batch(step: int) -> dict[str, torch.Tensor]:
    return hw._global_batches()[step]


def shard(batch: dict[str, torch.Tensor], mode: str) -> dict[str, Any]:
    """This rank's part of a global batch (the full batch on one rank)."""
    from slipstream.sequence import shard_causal_lm_batch, shard_causal_lm_batch_ring

    world, rank = dist.get_world_size(), dist.get_rank()
    if world == 1:
        return dict(batch)
    if mode == "ring":
        return shard_causal_lm_batch_ring(batch, world, rank)
    return shard_causal_lm_batch(batch, world, rank)


def _params(engine: Any) -> dict[str, torch.Tensor]:
    import slipstream

    with slipstream.zero.GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}


def train(
    mode: str,
    steps: range,
    *,
    load: str | None = None,
    save: str | None = None,
    save_after: int | None = None,
    batches: Any = global_batch,
    model: torch.nn.Module | None = None,
    loader: bool = False,
    **extra: Any,
) -> dict[str, Any]:
    """SP = world (``mode`` attention) through ``initialize``: optionally load a checkpoint,
    run ``steps`` (global batch indices), saving to ``save`` after step ``save_after``.
    ``loader``: read the batches from ``initialize``'s loader instead (which a checkpoint
    resumes where it stopped)."""
    import slipstream

    sp = dist.get_world_size()
    engine, _, data, _ = slipstream.initialize(
        model=model if model is not None else hw.make_model(MODEL),
        config=config(mode, sp, STAGE[mode], **extra),
        training_data=hw.LMData() if loader else None,
    )
    if load is not None:
        path, _ = engine.load_checkpoint(load)
        assert path is not None, load
    feed = iter(data) if loader else None
    losses = []
    for step in steps:
        out = engine(**(next(feed) if feed is not None else shard(batches(step), mode)))
        engine.backward(out.loss)
        engine.step()
        losses.append(float(out.loss.detach()))
        if save is not None and step == save_after:
            engine.save_checkpoint(save)
    result = {"losses": losses, "params": _params(engine), "step": engine.global_steps}
    engine.destroy()
    return result


BF16 = {"bf16": {"enabled": True}}


def _checkpointed() -> torch.nn.Module:
    model = hw.make_model(MODEL)
    model.gradient_checkpointing_enable()
    return model


def world_one(root: str, phase: str) -> dict[str, Any]:
    """One rank, SP=1. ``save``: an uninterrupted run of ``TOTAL`` steps for each mode's ZeRO
    stage, checkpointed after ``SAVE_AT``, and a bf16 run; ``resume``: load each mode's SP=2
    checkpoint and run the remaining steps. All read ``initialize``'s loader."""
    out: dict[Any, Any] = {}
    for mode in STAGE:
        if phase == "save":
            out[mode] = train(
                mode, range(TOTAL), save=f"{root}/sp1_{mode}", save_after=SAVE_AT - 1, loader=True
            )
        else:
            out[mode] = train(mode, range(SAVE_AT, TOTAL), load=f"{root}/sp2_{mode}", loader=True)
    if phase == "save":
        out["bf16"] = train("ring", range(hw.STEPS), **BF16)
        out["bf16_ulysses"] = train("ulysses", range(hw.STEPS), **BF16)
    return out


def world_two(root: str) -> dict[str, Any]:
    """SP=2 on 2 ranks. Each mode: resume the SP=1 checkpoint, and run ``SAVE_AT`` steps from scratch and checkpoint them. Then Ulysses on packed rows, and ring attention in bf16,
    with HF's gradient checkpointing, and with that under slipstream's
    ``activation_checkpointing`` (``cpu_checkpointing``)."""
    out: dict[Any, Any] = {}
    for mode in STAGE:
        out[("resume", mode)] = train(
            mode, range(SAVE_AT, TOTAL), load=f"{root}/sp1_{mode}", loader=True
        )
        out[("save", mode)] = train(
            mode, range(SAVE_AT), save=f"{root}/sp2_{mode}", save_after=SAVE_AT - 1, loader=True
        )
    out["packed"] = packed_ulysses(2)
    out["bf16"] = train("ring", range(hw.STEPS), **BF16)
    out["bf16_ulysses"] = train("ulysses", range(hw.STEPS), **BF16)
    out["hf_ckpt"] = train("ring", range(TOTAL), model=_checkpointed())
    out["ds_ckpt"] = train(
        "ring",
        range(TOTAL),
        model=_checkpointed(),
        activation_checkpointing={"cpu_checkpointing": True},
    )
    out["genome"] = genome_ring()
    return out


def packed_batch(step: int) -> dict[str, torch.Tensor]:
    """Global batch ``step`` of ``_ring_workloads.RingData(16, packed=True)`` in the loader's
    order: two documents per row (position ids restart at 0 at token 5)."""
    from tests.sequence._ring_workloads import RingData

    data = RingData(hw.SEQ, True)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(7)).tolist()
    items = [data[i] for i in order[step * hw.BATCH : (step + 1) * hw.BATCH]]
    return {key: torch.stack([item[key] for item in items]) for key in items[0]}


def packed_ulysses(stage: int) -> dict[str, Any]:
    """Ulysses SP = world on packed rows (``hw.STEPS`` steps)."""
    return train(
        "ulysses",
        range(hw.STEPS),
        batches=packed_batch,
        zero_optimization={"stage": stage, "stage3_param_persistence_threshold": 0},
    )


GENOME_ARGS = ["--sequence-parallel", "ring", "--seq-len", "32", "--steps", "2", "--batch", "1"]
GENOME_ARGS += ["--layers", "1", "--hidden", "32", "--no-compare"]


def genome_ring() -> str:
    """``examples/genome_lm.py --sequence-parallel ring`` on this world (its stdout)."""
    import contextlib
    import importlib.util
    import io
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "genome_lm.py"
    spec = importlib.util.spec_from_file_location("genome_lm_example", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        module.main(GENOME_ARGS)
    return out.getvalue()
