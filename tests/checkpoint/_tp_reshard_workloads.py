"""Rank bodies of the TP-degree resharding tests: save at one ``autotp_size``, load at another
(with another ZeRO stage and data-parallel size), continue training."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from slipstream.distributed.placement import tp_shard
from tests.parallel import _tp_workloads as tpw

BATCH = tpw.BATCH


def make_model(kind: str) -> nn.Module:
    return tpw.make_model(kind)


def _engine(kind: str, tp: int, stage: int, bf16: bool = False) -> Any:
    import slipstream

    dp = dist.get_world_size() // tp
    config: dict[str, Any] = {
        "bf16": {"enabled": bf16},
        "train_micro_batch_size_per_gpu": BATCH // dp,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage},
        "tensor_parallel": {"autotp_size": tp},
        "gradient_clipping": 0.0,
        "seed": 1,
    }
    engine, *_ = slipstream.initialize(model=make_model(kind), config=config)
    return engine


def _train(
    engine: Any, kind: str, tp: int, steps: list[tuple[torch.Tensor, torch.Tensor]]
) -> list[float]:
    """Losses of the global batch (averaged over the data-parallel ranks)."""
    dp = dist.get_world_size() // tp
    dp_rank = dist.get_rank() // tp  # tp is the innermost mesh axis
    rows = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
    losses = []
    for x, y in steps:
        loss = tpw._loss(engine, kind, x[rows], y[rows])
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / dist.get_world_size())
    return losses


def _has_tp(engine: Any) -> bool:
    return any(tp_shard(p) is not None for p in engine.module.parameters())


def _full_params(engine: Any) -> dict[str, torch.Tensor]:
    from slipstream.parallel.tensor import unshard_tp
    from slipstream.zero import GatheredParameters

    group = engine.mesh.get_group("tp") if _has_tp(engine) else None
    out = {}
    with GatheredParameters(list(engine.module.parameters())):  # ZeRO-3: the full tensors
        for n, p in engine.module.named_parameters():
            out[n] = (unshard_tp(p, group) if tp_shard(p) is not None else p.detach()).clone()
    return out


def scenario(kind: str, root: str) -> dict[str, Any]:
    """tp2 x ZeRO-1 trains 4 steps (saved after 2); resumed from step 2 at tp1 x dp2 with
    ZeRO-1 (which saves again, a tp1 checkpoint) and ZeRO-2; that tp1 checkpoint resumed
    at tp2 x ZeRO-1 (and, for the GPT, the tp2 one at tp1 x dp2 x ZeRO-3). Every resumed run must match the
    uninterrupted one."""
    data = tpw.batches()[:4]
    out: dict[str, Any] = {}
    engine = _engine(kind, 2, 1)
    _train(engine, kind, 2, data[:2])
    engine.save_checkpoint(f"{root}/{kind}", tag="tp2")
    out["saved"] = _full_params(engine)
    out["straight"] = _train(engine, kind, 2, data[2:])
    out["straight_params"] = _full_params(engine)
    engine.destroy()
    runs = [(1, 1, "tp2", "tp1"), (1, 2, "tp2", None), (2, 1, "tp1", None)]
    if kind == "gpt":  # tp2 -> tp1 x dp2 x ZeRO-3: each rank reads its shard of the joined
        runs.append((1, 3, "tp2", None))
    for tp, stage, load, save in runs:
        engine = _engine(kind, tp, stage)
        engine.load_checkpoint(f"{root}/{kind}", tag=load)
        label = f"{load}->tp{tp}z{stage}"
        out[f"{label} loaded"] = _full_params(engine)
        if save is not None:
            engine.save_checkpoint(f"{root}/{kind}", tag=save)
        out[label] = {"losses": _train(engine, kind, tp, data[2:]), "params": _full_params(engine)}
        engine.destroy()
    return out


def bf16_round_trip(root: str) -> None:
    """bf16 with fp32 masters: saved at tp2 x ZeRO-1, loaded at tp1 x dp2 x ZeRO-2 and saved
    again (compared by :func:`full_states`)."""
    engine = _engine("gpt", 2, 1, bf16=True)
    _train(engine, "gpt", 2, tpw.batches()[:2])
    engine.save_checkpoint(f"{root}/bf16", tag="tp2")
    engine.destroy()
    engine = _engine("gpt", 1, 2, bf16=True)
    engine.load_checkpoint(f"{root}/bf16", tag="tp2")
    engine.save_checkpoint(f"{root}/bf16", tag="tp1")
    engine.destroy()


def full_states(tag_dir: str, deepspeed: bool = False) -> dict[str, torch.Tensor]:
    """Every weight, master and optimizer state of a checkpoint as full tensors (TP slices
    joined; ``deepspeed``: a DeepSpeed checkpoint, read by slipstream's reader of them)."""
    from slipstream.checkpoint.deepspeed_pipe import open_deepspeed
    from slipstream.checkpoint.format import CheckpointReader, LogicalReader
    from slipstream.checkpoint.tp_layout import tp_view

    reader: LogicalReader
    reader = open_deepspeed(tag_dir) if deepspeed else tp_view(CheckpointReader(tag_dir), None)
    out = {}
    for kind in ("model", "master", "optim"):
        for name in reader.names(kind):
            out[f"{kind}/{name}"] = reader.read_full(f"{kind}/{name}")
    reader.close()
    return out


def world(kinds: list[str], root: str) -> dict[str, Any]:
    results: dict[str, Any] = {kind: scenario(kind, root) for kind in kinds}
    bf16_round_trip(root)
    if dist.get_rank() == 0:
        # The states saved at tp2 and saved again at tp1 after loading: the same tensors.
        results["states"] = {
            kind: (full_states(f"{root}/{kind}/tp2"), full_states(f"{root}/{kind}/tp1"))
            for kind in [*kinds, "bf16"]
        }
        # Exported to DeepSpeed (ZeRO-2 for 2 ranks): DeepSpeed's mp_rank_00, full tensors.
        from slipstream.checkpoint.to_deepspeed import export_deepspeed

        ds = export_deepspeed(f"{root}/gpt/tp2", f"{root}/gpt_ds", world_size=2, zero_stage=2)
        results["deepspeed"] = full_states(
            str(ds), deepspeed=True
        )  # the offline exports of the tp2 checkpoint: full tensors
        from slipstream.checkpoint.export import convert_checkpoint
        from slipstream.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        for kind in kinds:
            convert_checkpoint(f"{root}/{kind}/tp2", f"{root}/{kind}_export")
            results[kind]["export"] = tpw._read_export(f"{root}/{kind}_export")
            results[kind]["fp32"] = get_fp32_state_dict_from_zero_checkpoint(
                f"{root}/{kind}", tag="tp2"
            )
    dist.barrier()
    return results
